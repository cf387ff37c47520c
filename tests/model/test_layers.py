"""Shared layers on CPU: the LM-head product and the layout the runner gives weights."""
import torch

from pipespec.model.layers import LMHead, head_logits


def test_head_logits_equals_linear_for_any_row_count():
    w = torch.randn(1000, 64)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(head_logits(x, w), torch.nn.functional.linear(x, w))
    col = w.t().contiguous().t()                          # a column-major head takes F.linear
    x = torch.randn(3, 64)
    torch.testing.assert_close(head_logits(x, col), torch.nn.functional.linear(x, w))


def test_cpu_layout_keeps_heads_and_embeddings_row_major():
    from pipespec.model.layers import prefer_column_major
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(100, 8), "proj": torch.nn.Linear(8, 8),
                                 "head": LMHead(8, 100, bias=False)})
    prefer_column_major(model)
    assert model["embed"].weight.is_contiguous() and model["head"].weight.is_contiguous()
    assert model["proj"].weight.stride() == (1, 8)
