"""Shared layers on CPU: the LM-head and linear products."""
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


def test_cpu_linear_products_equal_f_linear_at_every_row_count():
    """Fewer than CPU_PRODUCT_ROWS rows take weight_times_rows (contiguous, any leading shape), more
    take F.linear; the same numbers either way, and the engine keeps the weights as loaded."""
    from pipespec.model.linear import CPU_PRODUCT_ROWS, linear
    w, b = torch.randn(48, 16), torch.randn(48)
    for rows in (0, 1, 2, 5, CPU_PRODUCT_ROWS - 1, CPU_PRODUCT_ROWS, 100):
        x = torch.randn(rows, 16)
        got = linear(x, w, b)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b))
        assert got.shape == (rows, 48) and got.is_contiguous()
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(linear(x, w), torch.nn.functional.linear(x, w))
    threads = torch.get_num_threads()
    try:                                   # one row on one thread takes F.linear
        torch.set_num_threads(1)
        x = torch.randn(1, 16)
        torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w, b))
    finally:
        torch.set_num_threads(threads)
