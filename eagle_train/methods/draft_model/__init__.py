"""The draft model: a small causal LM of the target's own architecture and vocabulary, which every engine serves as a
standalone drafter (vLLM `draft_model`, SGLang STANDALONE, TensorRT-LLM Draft_Target, llama.cpp `-md`)."""
