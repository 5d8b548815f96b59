"""Memory arithmetic for `--plan`: what each GPU holds for given settings, what activations cost, what
fits instead, and the printed report. Given a config, never a `--model` string."""
