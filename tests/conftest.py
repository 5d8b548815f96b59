import csv
from pathlib import Path

import pytest
import torch

from llama_scratch.data.labelled import load_sms_spam


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state, so failures reproduce."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def small_csv(tmp_path_factory) -> Path:
    """96 real SMS messages, half spam, as a user's CSV file with a header."""
    sms = load_sms_spam()
    ham = [t for t, y in zip(sms.texts, sms.labels, strict=True) if y == 0][:48]
    spam = [t for t, y in zip(sms.texts, sms.labels, strict=True) if y == 1][:48]
    path = tmp_path_factory.mktemp("data") / "sms.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["message", "category"])
        w.writerows([(t, "ham") for t in ham] + [(t, "spam") for t in spam])
    return path
