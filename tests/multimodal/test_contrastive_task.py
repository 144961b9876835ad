"""task=contrastive: caption tokens, last-token pooling, a few seeded steps lowering both losses, zero-shot
accuracy, and (slow) lmlab-train end to end."""

import csv

import pytest
import torch
from lmlab.multimodal.contrastive_task import PairCollate
from lmlab.multimodal.image_task import CaptionSource
from lmlab.multimodal.data import IMAGE_DATA, ZeroShotSet
from lmlab.multimodal.dual_encoder import CaptionTokens, DualEncoder, TextEncoder, load_dual_encoder, zero_shot_accuracy
from lmlab.nn.transformer import ModelConfig
from lmlab.tokenizers import ByteTokenizer, TOKENIZERS
from omegaconf import OmegaConf

from tests.conftest import run_cli

VISION = {"name": "vit", "image_size": 16, "patch_size": 4, "width": 32, "n_layers": 2, "n_heads": 2}
TEXT = OmegaConf.create({"d_model": 32, "n_layers": 2, "max_seq_len": 48, "norm": "rmsnorm", "ffn": "swiglu",
                         "position": "rope", "attention": {"name": "mha", "n_heads": 2}, "block": "prenorm"})
TEXT = OmegaConf.merge(OmegaConf.structured(ModelConfig), TEXT)


def test_caption_tokens_append_the_end_token_pad_after_it_and_cut_long_captions():
    tokenizer = ByteTokenizer()
    ids, last = CaptionTokens(tokenizer, max_len=8)(["ab", "abcd"])
    eot = tokenizer.eot_id
    assert ids.tolist() == [[97, 98, eot, eot, eot], [97, 98, 99, 100, eot]] and last.tolist() == [2, 4]
    tokens = CaptionTokens(tokenizer, max_len=4)
    ids, last = tokens(["abcdefgh"])
    assert ids.tolist() == [[97, 98, 99, eot]] and last.tolist() == [3] and tokens.truncated == 1


def test_text_encoder_reads_the_last_token_and_padding_changes_nothing():
    torch.manual_seed(0)
    encoder = TextEncoder(TEXT, vocab_size=260).eval()
    assert not hasattr(encoder.transformer, "lm_head")
    tokens = CaptionTokens(ByteTokenizer(), 48)
    ids, last = tokens(["a red circle", "two blue squares at the top left"])
    alone, alone_last = tokens(["a red circle"])
    torch.testing.assert_close(encoder(ids, last)[0], encoder(alone, alone_last)[0])
    hidden = encoder.transformer.hidden_states(ids)
    torch.testing.assert_close(encoder(ids, last)[1], hidden[1, last[1]])


def _tiny_setup(loss: str):
    torch.manual_seed(0)
    splits = IMAGE_DATA.build({"name": "synthetic", "n_train": 64, "n_val": 8, "n_zero_shot": 16}).load(16, 0)
    tokenizer = ByteTokenizer()
    model = DualEncoder(VISION, TEXT, loss, tokenizer.vocab_size, embed_dim=16)
    batch = PairCollate(CaptionTokens(tokenizer, 48))([splits.train[i] for i in range(16)])
    return model, batch


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_a_few_seeded_steps_lower_the_loss_and_move_the_temperature(loss):
    model, batch = _tiny_setup(loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start_scale = model.loss_fn.log_scale.item()
    losses = []
    for _ in range(25):
        out = model(batch["images"], batch["ids"], batch["last"])
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
        losses.append(out["loss"].item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert model.loss_fn.log_scale.item() != start_scale


class _Oracle(torch.nn.Module):
    """Embeds an image (its pixels hold a number k) and a text ("caption k") as one-hot k: a perfect model,
    except for the images told to be wrong."""

    def __init__(self, n: int, wrong: set[int]):
        super().__init__()
        self.n, self.wrong, self.anchor = n, wrong, torch.nn.Parameter(torch.zeros(()))

    def embed_images(self, images):
        k = images[:, 0, 0, 0].round().long()
        k = torch.where(torch.isin(k, torch.tensor(sorted(self.wrong))), (k + 1) % self.n, k)
        return torch.nn.functional.one_hot(k, self.n).float()

    def embed_texts(self, ids, last):
        tokenizer = ByteTokenizer()
        return torch.nn.functional.one_hot(torch.tensor(
            [int(tokenizer.decode(row[:end].tolist()).split()[1]) for row, end in zip(ids, last)]), self.n).float()


def test_zero_shot_accuracy_picks_the_nearest_candidate():
    n = 7  # images 0..6; image i's candidates are captions i, i+1, i+2 (mod n), the true one first
    images = [{"image": torch.full((3, 2, 2), float(i))} for i in range(n)]
    candidates = torch.tensor([[i, (i + 1) % n, (i + 2) % n] for i in range(n)])
    probe = ZeroShotSet(images, [f"caption {i}" for i in range(n)], candidates, torch.zeros(n, dtype=torch.long))
    tokens = CaptionTokens(ByteTokenizer(), 16)
    assert zero_shot_accuracy(_Oracle(n, set()), probe, tokens, batch_size=3) == 1.0
    assert zero_shot_accuracy(_Oracle(n, {2, 5}), probe, tokens, batch_size=3) == pytest.approx(5 / 7)


def test_caption_source_trains_a_bpe_on_the_captions(tmp_path):
    captions = ["two red circles at the top left", "a blue square in the center"] * 20
    tokenizer = TOKENIZERS.build({"name": "bpe", "vocab_size": 300}, CaptionSource(captions), str(tmp_path), False)
    assert len(tokenizer.encode("two red circles")) == 3  # whole words after training on them
    assert CaptionSource(captions).fingerprint() != CaptionSource(captions[:2]).fingerprint()


SMOKE = ["task=contrastive", "model.d_model=32", "model.n_layers=2", "model.attention.n_heads=2", "model.max_seq_len=32",
         "vision_encoder.width=32", "vision_encoder.n_layers=2", "vision_encoder.n_heads=2", "vision_encoder.patch_size=8",
         "image_data.n_train=256", "image_data.n_val=32", "image_data.n_zero_shot=32", "task.batch_size=32",
         "trainer.max_steps=20", "trainer.val_every=20", "sched.warmup_steps=2", "trainer.progress_bar=false",
         "logger=csv"]


@pytest.mark.slow
def test_lmlab_train_task_contrastive_end_to_end(tmp_path):
    result = run_cli(["lmlab-train", *SMOKE, "contrastive_loss=siglip", f"cache_dir={tmp_path / 'cache'}",
                      f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    with next((tmp_path / "run" / "csv").rglob("metrics.csv")).open() as f:
        logged = [row for row in csv.DictReader(f) if row.get("val/zero_shot_acc")]
    assert logged and 0.0 <= float(logged[-1]["val/zero_shot_acc"]) <= 1.0 and float(logged[-1]["val/loss"]) > 0
    model, tokenizer, config = load_dual_encoder(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert config.contrastive_loss.name == "siglip" and model.image_encoder.width == 32
    assert model.embed_images(torch.rand(2, 3, 32, 32)).shape == (2, 64)  # task.embed_dim
