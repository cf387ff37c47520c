"""Parsers of model output for the chat API: reasoning blocks and tool calls in each family's markup.

They run on the detokenized text after the engine (docs/architecture.md), one parser object per request, fed
the text as it is generated; `chat_output.ChatOutputParser` combines them into OpenAI messages and
streamed deltas."""
