"""Hugging Face weights (safetensors, the sharded layout ``from_pretrained`` loads): written, never loaded here.

``files`` is the layout (the plan of shards, one file's writing, the index last, the one-file form);
``parallel_save`` is ``save_16bit_model``'s collective save, every rank writing its share;
``export`` writes them offline from a checkpoint's files.
"""
