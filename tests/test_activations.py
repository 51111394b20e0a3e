"""Lesson 13, in one process: the GPT and its text, the activation-memory formula against what autograd saves, and
recomputation (by hand, torch's full and selective) against none.

Measured with ``saved_tensors`` (every tensor autograd saves, through ``saved_tensors_hooks``) and ``HeldMemory``
(every storage that forward allocates and leaves alive). In fp32 on a CPU the formula is exact: each test compares
bytes with ``==``, a tolerance of zero.
"""

import pytest
import torch

import common.recompute as recompute_module
from common.activations import (
    HeldMemory,
    activation_bytes_per_layer,
    korthikanti_bytes,
    layer_total,
    saved_tensors,
)
from common.distributed import ConfigurationError
from common.experiments.activations import build_gpt, layer_saved_bytes, token_batch
from common.gpt import generate, next_token_loss
from common.recompute import RECOMPUTE_MODES, apply_recomputation
from common.text import decode, default_text_files, encode, load_text

CONFIG = dict(context=32, d_model=32, num_heads=4, num_layers=2, dropout=0.1)
BATCH = 4
SBH_BYTES = 4 * CONFIG["context"] * BATCH * CONFIG["d_model"]  # one fp32 activation of the layer's width


def test_the_papers_16_bit_formula_is_the_sum_of_its_terms():
    for seq, batch, hidden, heads in [(2048, 1, 12288, 96), (512, 8, 1024, 16), (64, 4, 64, 4)]:
        in_16_bit = dict(value_bytes=2, mask_bytes=1, norm_statistics=False)
        terms = activation_bytes_per_layer(seq, batch, hidden, heads, **in_16_bit)
        assert layer_total(terms) == korthikanti_bytes(seq, batch, hidden, heads)


@pytest.mark.parametrize("dropout", [0.1, 0.0], ids=["dropout", "no-dropout"])
def test_each_module_of_a_layer_saves_the_formulas_terms_one_by_one(dropout):
    measured = layer_saved_bytes(seq=16, batch=2, d_model=32, heads=4, dropout=dropout)
    for name, part in measured["by module"].items():
        # One saved tensor per term, the same sizes: a missing, extra or wider tensor changes the list.
        assert sorted(measured_bytes for measured_bytes in part["measured"]) == sorted(part["formula"].values()), name
    assert measured["measured"] == measured["formula"]


def test_on_a_cpu_dropout_keeps_its_mask_in_the_activations_dtype_not_one_byte():
    block = build_gpt(CONFIG).blocks[0]
    X = torch.randn(2, 16, 32, requires_grad=True)
    with saved_tensors(block.parameters()) as log:
        block(X)
    assert {dtype for _, dtype, _ in log.tensors} == {torch.float32}  # no bool mask: F.dropout's CPU path


@pytest.mark.parametrize("shape", [(16, 1), (32, 1), (32, 4), (64, 2)], ids=lambda shape: f"s{shape[0]}b{shape[1]}")
def test_a_layer_saves_exactly_the_formulas_bytes_for_several_lengths_and_batches(shape):
    seq, batch = shape
    measured = layer_saved_bytes(seq, batch, d_model=32, heads=4)
    assert measured["measured"] == measured["formula"]


def test_the_attention_term_grows_with_the_square_of_the_sequence():
    short, long = (layer_saved_bytes(seq, 2, d_model=32, heads=4)["measured"] for seq in (32, 64))
    # Twice the tokens: everything linear doubles; the s^2 part (12 a s^2 b bytes in fp32 with fp32 masks) is 4x.
    assert long - 2 * short == 12 * 4 * 2 * (64**2 - 2 * 32**2)


def gradients_after_one_step(mode: str) -> list[torch.Tensor]:
    model = apply_recomputation(build_gpt(CONFIG), mode)
    tokens, targets = token_batch(CONFIG, BATCH)
    torch.manual_seed(7)  # the dropout masks
    loss = next_token_loss(model(tokens), targets)
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("mode", RECOMPUTE_MODES[1:])
def test_recomputation_gives_the_same_loss_and_gradients_bit_for_bit_with_dropout(mode):
    reference, recomputed = gradients_after_one_step("none"), gradients_after_one_step(mode)
    assert all(torch.equal(a, b) for a, b in zip(recomputed, reference))


def test_without_the_random_state_put_back_the_recomputed_dropout_differs(monkeypatch):
    monkeypatch.setattr(recompute_module, "set_random_state", lambda state, device: None)  # the replay left out
    reference, recomputed = gradients_after_one_step("none"), gradients_after_one_step("by-hand")
    assert torch.equal(recomputed[0], reference[0])  # forward is the same: the loss does not see the replay
    assert not all(torch.equal(a, b) for a, b in zip(recomputed[1:], reference[1:]))


def kept_after_forward(mode: str) -> dict:
    model = apply_recomputation(build_gpt(CONFIG), mode)
    tokens, targets = token_batch(CONFIG, BATCH)
    with saved_tensors(model.parameters()) as saved, HeldMemory() as held:
        loss = next_token_loss(model(tokens), targets)
        kept = held.bytes
    del loss
    return {"saved": saved.bytes, "held": kept}


def test_recomputation_keeps_only_each_blocks_input_and_selective_the_linears_outputs_too():
    kept = {mode: kept_after_forward(mode) for mode in RECOMPUTE_MODES}
    seq, hidden, heads, layers = CONFIG["context"], CONFIG["d_model"], CONFIG["num_heads"], CONFIG["num_layers"]
    per_layer = layer_total(activation_bytes_per_layer(seq, BATCH, hidden, heads))
    # Full recomputation keeps one tensor per layer, its input, instead of the formula's bytes.
    for mode in ("by-hand", "full"):
        assert kept["none"]["saved"] - kept[mode]["saved"] == layers * (per_layer - SBH_BYTES)
    # Selective keeps, besides, the outputs of q, k, v, the output projection, the MLP's 4h-wide up and its down.
    assert kept["selective"]["saved"] - kept["full"]["saved"] == layers * 9 * SBH_BYTES
    # The two measurements agree: what autograd saves is what forward leaves alive, but for the tokens and the
    # targets (int64, created before forward, saved by the embedding and the loss) and the loss (alive, not saved).
    tokens_and_targets = 2 * BATCH * seq * 8
    assert all(counts["saved"] - tokens_and_targets + 4 == counts["held"] for counts in kept.values()), kept


def test_the_default_text_is_the_wheels_nn_sources_split_90_10_into_windows_shifted_by_one():
    text = load_text(context=64)
    files = default_text_files()
    assert text.num_bytes == sum(path.stat().st_size for path in files) and len(files) >= 20
    inputs, targets = text.train.tensors
    assert inputs.shape[1] == targets.shape[1] == 64 and inputs.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # the target at each position is the next byte
    assert torch.equal(inputs[1:, 0], targets[:-1, -1])  # windows side by side: one starts where the last ended
    assert abs(len(text.validation) / (len(text.train) + len(text.validation)) - 0.1) < 0.01
    first = b"".join(path.read_bytes() for path in files)[:64]
    assert decode(inputs[0]) == first.decode() and torch.equal(encode(first.decode())[0], inputs[0])


def test_a_missing_text_file_fails_at_once_with_a_clear_message(tmp_path):
    with pytest.raises(ConfigurationError, match=r"no text file at .*nowhere\.txt.*--text"):
        load_text(tmp_path / "nowhere.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ConfigurationError, match="empty"):
        load_text(tmp_path / "empty.txt")


def test_the_gpt_learns_the_text_validation_loss_below_2_6_nats_in_100_steps():
    torch.set_num_threads(1)
    config = dict(context=64, d_model=64, num_heads=4, num_layers=2, dropout=0.1)
    text = load_text(context=64)
    model = build_gpt(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    validation = text.validation[:64]

    def validation_loss():
        model.eval()
        with torch.no_grad():
            loss = next_token_loss(model(validation[0]), validation[1]).item()
        model.train()
        return loss

    before = validation_loss()
    for _ in range(100):
        tokens, targets = text.train[torch.randint(len(text.train), (16,), generator=generator)]
        optimizer.zero_grad()
        next_token_loss(model(tokens), targets).backward()
        optimizer.step()
    after = validation_loss()
    assert before > 5.0 and after < 2.6, (before, after)  # ln 256 = 5.55: a uniform guess among 256 bytes
    model.eval()
    prompt = encode("import torch\n")
    sample = generate(model, prompt, new_tokens=20, window=64, seed=1)
    assert sample.shape == (1, 13 + 20) and torch.equal(sample[:, :13], prompt)
    assert torch.equal(sample, generate(model, prompt, new_tokens=20, window=64, seed=1))  # its own generator
