"""llama-cpp-python model runtime: contexts, sequences, scheduler, restore and save points."""
