"""What `gradsync train` assumes about a user's dataset when TrainData leaves it out.

The default loss, item count and item name come from the first sample's target:
floating targets are a regression (mean squared error, an item is a sample);
integer targets are cross-entropy classes, and the item is a target that is not
-100 -- named "tokens" when a sample holds a sequence of them, "samples" when it
holds one label (classification: the throughput must not read "tokens/s").
"""

import pytest
import torch
from torch.utils.data import TensorDataset

from gradsync.errors import UsageError
from gradsync.train.task.build import TrainData, complete


def _data(x, y, **kw):
    return complete(TrainData(TensorDataset(x, y), **kw))


def test_integer_label_per_sample_is_classification_counted_in_samples():
    d = _data(torch.randn(6, 4), torch.tensor([0, 1, 2, 1, 0, -100]))
    assert d.item_name == "samples"
    x, y = d.collate_fn([d.train[i] for i in range(6)])
    assert d.items_fn(x, y) == 5  # the -100 label is not an item
    logits = torch.randn(6, 3)
    ref = torch.nn.functional.cross_entropy(logits[:5], y[:5])
    assert torch.allclose(d.loss_fn(logits, y), ref)


def test_integer_sequence_targets_are_tokens():
    y = torch.tensor([[1, 2, -100], [3, -100, -100]])
    d = _data(torch.zeros(2, 3, dtype=torch.long), y)
    assert d.item_name == "tokens"
    assert d.items_fn(*d.collate_fn([d.train[0], d.train[1]])) == 3


def test_floating_targets_are_a_regression_counted_in_samples():
    d = _data(torch.randn(5, 4), torch.randn(5, 2))
    assert d.item_name == "samples"
    x, y = d.collate_fn([d.train[i] for i in range(5)])
    assert d.items_fn(x, y) == 5


def test_a_name_given_is_kept():
    d = _data(torch.randn(3, 4), torch.tensor([0, 1, 2]), item_name="images")
    assert d.item_name == "images"


def test_integer_labels_of_any_width_train_with_the_default_loss():
    """Labels from numpy are often int32; cross-entropy wants int64: converted."""
    y64 = torch.tensor([0, 1, 2, 1])
    d = _data(torch.randn(4, 4), y64.int())
    x, y = d.collate_fn([d.train[i] for i in range(4)])
    assert y.dtype == torch.int32
    logits = torch.randn(4, 3)
    assert torch.equal(d.loss_fn(logits, y), torch.nn.functional.cross_entropy(logits, y64))


def test_regression_output_of_n_by_1_against_n_targets_is_not_broadcast():
    d = _data(torch.randn(5, 4), torch.randn(5))
    x, y = d.collate_fn([d.train[i] for i in range(5)])
    pred = torch.randn(5, 1)
    assert torch.equal(d.loss_fn(pred, y), torch.nn.functional.mse_loss(pred[:, 0], y))
    with pytest.raises(UsageError, match="same shape"):
        d.loss_fn(torch.randn(5, 2), y)


def test_default_loss_errors_name_what_is_wrong():
    d = _data(torch.randn(4, 4), torch.tensor([0, 1, 2, 1]))
    with pytest.raises(UsageError, match=r"keys \['hidden'\].*logits"):
        d.loss_fn({"hidden": torch.randn(4, 3)}, torch.tensor([0, 1, 2, 1]))
    with pytest.raises(UsageError, match="boolean targets"):
        d.loss_fn(torch.randn(4, 3), torch.tensor([True, False, True, False]))
