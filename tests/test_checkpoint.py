import json
import pickle

import pytest
import torch
from torch import nn

from common import checkpoint
from common.checkpoint import atomic_write, load_checkpoint, save_checkpoint, unwrap, write_json
from common.models import LeNet


def trained_lenet(seed):
    torch.manual_seed(seed)
    model = LeNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    optimizer.step()  # fills the momentum buffers, which a resume needs
    return model, optimizer


def test_a_checkpoint_restores_model_optimizer_epoch_and_step(tmp_path):
    model, optimizer = trained_lenet(seed=0)
    save_checkpoint(tmp_path / "ckpt.pt", model, optimizer, epoch=3, step=120)
    fresh_model, fresh_optimizer = trained_lenet(seed=1)
    assert load_checkpoint(tmp_path / "ckpt.pt", fresh_model, fresh_optimizer) == {"epoch": 3, "step": 120}
    torch.testing.assert_close(fresh_model.state_dict(), model.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(fresh_optimizer.state_dict(), optimizer.state_dict(), rtol=0, atol=0)


def test_a_wrapped_model_is_saved_without_the_wrapper_prefix(tmp_path):
    model, optimizer = trained_lenet(seed=0)
    wrapped = nn.DataParallel(model)  # any wrapper with .module; DDP is checked in test_multiprocess.py
    assert unwrap(wrapped) is model
    save_checkpoint(tmp_path / "ckpt.pt", wrapped, optimizer, epoch=1, step=1)
    keys = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"].keys()
    assert set(keys) == set(model.state_dict()) and not any(key.startswith("module.") for key in keys)


def test_only_global_rank_0_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "is_main", lambda: False)
    model, optimizer = trained_lenet(seed=0)
    save_checkpoint(tmp_path / "ckpt.pt", model, optimizer, epoch=1, step=1)
    write_json(tmp_path / "metrics.json", {"a": 1})
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_the_previous_file_whole_and_no_temporary_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"the previous checkpoint")

    def crash_half_way(file):
        file.write(b"half of a new")
        raise KeyboardInterrupt  # a kill in the middle of saving

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, crash_half_way)
    assert path.read_bytes() == b"the previous checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_loading_refuses_a_checkpoint_that_would_run_code(tmp_path):
    model, optimizer = trained_lenet(seed=0)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1, "step": 1,
                "payload": ArbitraryObject()}, tmp_path / "ckpt.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_checkpoint(tmp_path / "ckpt.pt", model, optimizer)


class ArbitraryObject:
    """Stands for any pickled object: unpickling it could call any function."""


def test_write_json_writes_indented_json_and_creates_the_folder(tmp_path):
    write_json(tmp_path / "runs" / "metrics.json", {"accuracy": 0.5, "epochs": [1, 2]})
    text = (tmp_path / "runs" / "metrics.json").read_text()
    assert json.loads(text) == {"accuracy": 0.5, "epochs": [1, 2]} and "\n  " in text
