"""pipespec: an LLM inference engine where MTP speculative decoding works under pipeline parallelism."""
from pipespec.engine.llm import LLM
from pipespec.engine.outputs import CompletionOutput, RequestOutput
from pipespec.sampling import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "__version__"]
