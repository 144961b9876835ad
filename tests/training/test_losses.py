import torch
import torch.nn.functional as F

from lmlab.training.losses import LOSSES


def test_cross_entropy_matches_torch_and_ignores_index():
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    loss = LOSSES.build("cross_entropy")
    torch.testing.assert_close(loss(logits, targets)["loss"],
                               F.cross_entropy(logits.reshape(10, 11), targets.reshape(10)))
    targets[0, :3] = -100
    kept = targets.reshape(10) != -100
    torch.testing.assert_close(loss(logits, targets)["loss"],
                               F.cross_entropy(logits.reshape(10, 11)[kept], targets.reshape(10)[kept]))


def test_cross_entropy_is_float32_under_bf16_logits():
    logits = torch.randn(4, 7, dtype=torch.bfloat16)
    out = LOSSES.build({"name": "cross_entropy", "label_smoothing": 0.1})(logits, torch.randint(0, 7, (4,)))
    assert out["loss"].dtype == torch.float32


def test_z_loss_adds_weighted_squared_log_normaliser_on_kept_tokens():
    logits, targets = torch.randn(2, 5, 11) * 3, torch.randint(0, 11, (2, 5))
    targets[1, 4] = -100
    out = LOSSES.build({"name": "cross_entropy", "z_loss": 1e-2})(logits, targets)
    kept = targets.reshape(-1) != -100
    z = logits.reshape(10, 11)[kept].logsumexp(-1).pow(2).mean()
    torch.testing.assert_close(out["z_loss"], z)
    torch.testing.assert_close(out["loss"], out["ce"] + 1e-2 * z)
