"""The fine-tuning loop: settings (the one source of defaults), optimizer, evaluation, the frozen-prefix
cache, interrupts and the run's output directory."""
