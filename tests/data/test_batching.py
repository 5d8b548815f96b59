"""Texts to padded batches: token ids with BOS, truncation, padding on either side, length-sorted batches."""

import pytest
import torch

from llama_scratch.data.batching import collate, default_max_length, encode_texts, length_sorted_batches


class ByteTokenizer:
    """Stands in for `Tokenizer`: one token per UTF-8 byte, BOS = 256."""

    pad_id = 0

    def encode(self, text, bos=True, eos=False):
        return [256] * bos + list(text.encode("utf-8")) + [257] * eos


def test_encode_texts_adds_bos_and_truncates_the_end():
    ids, truncated = encode_texts(["ab", "abcdef"], ByteTokenizer(), max_length=4)
    assert ids == [[256, 97, 98], [256, 97, 98, 99]] and truncated == 1
    full, none = encode_texts(["ab", "abcdef"], ByteTokenizer())
    assert none == 0 and default_max_length(full, 512) == 7 and default_max_length(full, 5) == 5


@pytest.mark.parametrize("side", ["right", "left"])
def test_collate_pads_to_the_batch_longest(side):
    batch = collate([([5, 6, 7], 1), ([8], 0)], pad_id=0, padding_side=side)
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == batch["labels"].dtype == torch.long
    if side == "right":
        assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
        assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    else:
        assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
        assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["labels"].tolist() == [1, 0]
    with pytest.raises(ValueError, match="padding_side"):
        collate([([1], 0)], pad_id=0, padding_side="middle")


def test_length_sorted_batches_cover_every_row_once_across_processes():
    lengths = [5, 1, 4, 1, 3, 2, 9]
    assert length_sorted_batches(lengths, 3) == [[1, 3, 5], [4, 2, 0], [6]]
    shares = [length_sorted_batches(lengths, 2, rank, 3) for rank in range(3)]
    assert sorted(i for share in shares for batch in share for i in batch) == list(range(7))
    assert shares[0] == [[1, 4], [6]]  # every third row of the sorted order 1 3 5 4 2 0 6
