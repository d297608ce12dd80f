"""training_data: merge responses, apply the target's chat template, mask exactly the generated
tokens, shuffle, split and shard in bounded memory.

``masks`` locates each generated turn in the template's render; ``build`` streams the rows
through tokenization, an on-disk bucket sort and the shard writers.
"""

from eagle3_pipeline.training_data.build import (
    FREQ_SCHEMA,
    SHARD_SCHEMA,
    DataprepStats,
    DatasetStats,
    build_training_data,
    load_tokenizer,
    read_manifest,
    shuffle_key,
    split_of,
    stored_conversation,
)
from eagle3_pipeline.training_data.masks import (
    FINISHED,
    ChatRenderer,
    Conversation,
    ReasoningMode,
    TemplateMismatch,
    template_message,
    tokenize_conversation,
)

__all__ = [
    "FINISHED",
    "FREQ_SCHEMA",
    "SHARD_SCHEMA",
    "ChatRenderer",
    "Conversation",
    "DataprepStats",
    "DatasetStats",
    "ReasoningMode",
    "TemplateMismatch",
    "build_training_data",
    "load_tokenizer",
    "read_manifest",
    "shuffle_key",
    "split_of",
    "stored_conversation",
    "template_message",
    "tokenize_conversation",
]
