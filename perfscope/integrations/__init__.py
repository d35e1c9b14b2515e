"""Callbacks that record training run by a framework (Lightning, the Hugging Face Trainer) into a
perfscope store: one line of change in the user's code, `callbacks=[PerfscopeCallback("traces/")]`."""
