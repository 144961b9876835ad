import torch
import torch.nn.functional as F

from lmlab.training.losses import LOSSES


def test_cross_entropy_matches_torch_and_ignores_index():
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    loss = LOSSES.build("cross_entropy")
    torch.testing.assert_close(loss(logits, targets), F.cross_entropy(logits.reshape(10, 11), targets.reshape(10)))
    targets[0, :3] = -100
    kept = targets.reshape(10) != -100
    torch.testing.assert_close(loss(logits, targets),
                               F.cross_entropy(logits.reshape(10, 11)[kept], targets.reshape(10)[kept]))


def test_cross_entropy_is_float32_under_bf16_logits():
    logits = torch.randn(4, 7, dtype=torch.bfloat16)
    out = LOSSES.build({"name": "cross_entropy", "label_smoothing": 0.1})(logits, torch.randint(0, 7, (4,)))
    assert out.dtype == torch.float32
