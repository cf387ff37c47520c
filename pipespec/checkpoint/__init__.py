"""Finding and reading a checkpoint: the default model, a Hugging Face folder or Hub id, a GGUF file
(converted once into a cached folder), its architecture config and its tokenizer. The engine uses
this to know what it serves; the computation lives in `pipespec.model`, which the engine does not
import (DESIGN.md, Layout)."""
