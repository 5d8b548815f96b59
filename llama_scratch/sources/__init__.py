"""What `--model X` means, once for every command: a preset, a checkpoint directory, a Hub repo id, a
GGUF file or the default, made local (fetched, converted) and loaded; the device and dtype to compute in."""
