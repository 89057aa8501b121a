"""The label-scoring engine: models in, label log-probabilities per (template, example) pair out.

``models`` loads a causal LM (the embedded SmolLM2, a Hugging Face folder or id); ``target`` scores pairs
in-process (shared prefix, packed batches, ``packing`` for the layout, ``packed_llama`` for the written-out
Llama pass, ``pair_cache`` for pairs seen before); ``endpoints`` scores them through an OpenAI-compatible
server. Everything above this folder sees one interface: ``score(template, texts) -> log-probs``.
"""
