"""Both releases' ``layers.logits_processor.LogitsProcessor``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LogitsProcessorOutput:
    next_token_logits: Any
    hidden_states: Any = None


class LogitsProcessor(torch.nn.Module):
    """The next-token logits of each request's last token (extend mode, no logprobs)."""

    def forward(
        self,
        input_ids: Any,
        hidden_states: Any,
        lm_head: Any,
        logits_metadata: Any,
        aux_hidden_states: Any = None,
        hidden_states_before_norm: Any = None,
    ) -> LogitsProcessorOutput:
        last = torch.tensor(logits_metadata.extend_seq_lens).cumsum(0) - 1
        return LogitsProcessorOutput(next_token_logits=lm_head(hidden_states[last]))
