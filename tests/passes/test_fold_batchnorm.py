"""fold-batchnorm: Conv/ConvTranspose/Gemm/MatMul (+bias) followed by inference BatchNormalization."""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from passes_helpers import check_pass, make_model, node, op_counts, rand, random_feeds, run_ort

from passes import create_pass, run_pass, run_pipeline
from passes.generic.fold_batchnorm import FoldBatchNorm


def bn_params(channels: int, prefix: str = "") -> dict[str, np.ndarray]:
    return {
        f"{prefix}gamma": rand(channels, seed=11, positive=True),
        f"{prefix}beta": rand(channels, seed=12),
        f"{prefix}mean": rand(channels, seed=13),
        f"{prefix}var": rand(channels, seed=14, positive=True),
    }


def bn(x: str, y: str, prefix: str = "", **attrs):
    return node("BatchNormalization", [x, f"{prefix}gamma", f"{prefix}beta", f"{prefix}mean", f"{prefix}var"], [y],
                epsilon=1e-3, **attrs)


def conv_bn(bias: bool = True, extra_consumer: bool = False, **bn_attrs):
    inits = {"W": rand(4, 3, 3, 3), **bn_params(4)}
    if bias:
        inits["B"] = rand(4, seed=1)
    nodes = [node("Conv", ["x", "W", "B"] if bias else ["x", "W"], ["c"], pads=[1, 1, 1, 1]), bn("c", "y", **bn_attrs)]
    outputs = ["y"]
    if extra_consumer:
        nodes.append(node("Relu", ["c"], ["z"]))
        outputs.append("z")
    return make_model(nodes, {"x": [2, 3, 6, 6]}, outputs, inits)


@pytest.mark.parametrize("bias", [True, False])
def test_conv_bn_folds(bias):
    model = conv_bn(bias)
    stats = check_pass(model, "fold-batchnorm")
    assert stats.counts == {"conv": 1} and stats.modified
    assert op_counts(model) == {"Conv": 1}
    assert set(model.graph.initializers) <= {"W", "B", "W_bias"}  # BN parameters are gone


def test_conv_transpose_bn_folds():
    inits = {"W": rand(3, 4, 2, 2), **bn_params(4)}
    nodes = [node("ConvTranspose", ["x", "W"], ["c"], strides=[2, 2]), bn("c", "y")]
    model = make_model(nodes, {"x": [1, 3, 4, 4]}, ["y"], inits)
    assert check_pass(model, "fold-batchnorm").counts == {"conv_transpose": 1}
    assert op_counts(model) == {"ConvTranspose": 1}


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_bn_folds(trans_b):
    weight = rand(5, 6) if trans_b else rand(6, 5)
    inits = {"W": weight, "B": rand(5, seed=1), **bn_params(5)}
    nodes = [node("Gemm", ["x", "W", "B"], ["g"], transB=trans_b, beta=0.5), bn("g", "y")]
    model = make_model(nodes, {"x": [3, 6]}, ["y"], inits)
    assert check_pass(model, "fold-batchnorm").counts == {"gemm": 1}
    assert op_counts(model) == {"Gemm": 1}


def test_matmul_bn_folds_on_rank2_output():
    """[N, K] @ W[K, C] -> [N, C]: BN's axis 1 is the weight's output axis."""
    nodes = [node("MatMul", ["x", "W"], ["m"]), bn("m", "y")]
    model = make_model(nodes, {"x": [3, 6]}, ["y"], {"W": rand(6, 5), **bn_params(5)})
    assert check_pass(model, "fold-batchnorm").counts == {"matmul": 1}
    assert op_counts(model) == {"MatMul": 1, "Add": 1}


@pytest.mark.parametrize("bias_first", [False, True])
def test_matmul_add_bn_folds_bias(bias_first):
    add_inputs = ["b", "m"] if bias_first else ["m", "b"]
    model = make_model(
        [node("MatMul", ["x", "W"], ["m"]), node("Add", add_inputs, ["a"]), bn("a", "y")],
        {"x": [3, 6]}, ["y"], {"W": rand(6, 5), "b": rand(5, seed=2), **bn_params(5)},
    )
    assert check_pass(model, "fold-batchnorm").counts == {"matmul_add": 1}
    assert op_counts(model) == {"MatMul": 1, "Add": 1}


def test_left_weight_matmul_bn_folds_on_rank3_output():
    """W[C, K] @ x[N, K, L] -> [N, C, L] (a 1x1 Conv1d): BN's axis 1 is the weight's row axis."""
    nodes = [node("MatMul", ["W", "x"], ["m"]), bn("m", "y")]
    model = make_model(nodes, {"x": [2, 6, 7]}, ["y"], {"W": rand(5, 6), **bn_params(5)})
    assert check_pass(model, "fold-batchnorm").counts == {"matmul": 1}
    assert op_counts(model) == {"MatMul": 1, "Add": 1}


def near_miss_reasons(model) -> str:
    return " | ".join(str(m) for m in FoldBatchNorm().near_misses(model))


def test_no_fold_when_conv_output_has_another_consumer():
    model = conv_bn(extra_consumer=True)
    stats = check_pass(model, "fold-batchnorm")
    assert not stats.modified and stats.counts == {}
    assert op_counts(model) == {"Conv": 1, "BatchNormalization": 1, "Relu": 1}
    assert "other uses" in near_miss_reasons(model)


def test_no_fold_in_training_mode():
    inits = {"W": rand(4, 3, 3, 3), **bn_params(4)}
    batchnorm = bn("c", "y", training_mode=1)
    batchnorm.output.extend(["running_mean", "running_var"])
    model = make_model([node("Conv", ["x", "W"], ["c"]), batchnorm], {"x": [2, 3, 6, 6]}, ["y"], inits)
    stats = run_pass("fold-batchnorm", create_pass("fold-batchnorm"), model)  # ORT cannot run training mode
    assert (stats.modified, stats.counts) == (False, {})
    assert op_counts(model) == {"Conv": 1, "BatchNormalization": 1}
    assert "training mode" in near_miss_reasons(model)


def test_no_fold_when_matmul_output_is_rank3():
    """[N, L, K] @ W[K, C] -> [N, L, C]: BN normalises L, which the weight does not produce."""
    nodes = [node("MatMul", ["x", "W"], ["m"]), bn("m", "y")]
    model = make_model(nodes, {"x": [2, 5, 6]}, ["y"], {"W": rand(6, 4), **bn_params(5)})
    assert check_pass(model, "fold-batchnorm").counts == {}
    assert "exact only for rank 2" in near_miss_reasons(model)


def test_no_fold_when_weight_is_not_constant():
    nodes = [node("MatMul", ["x", "w"], ["m"]), bn("m", "y")]
    model = make_model(nodes, {"x": [3, 6], "w": [6, 5]}, ["y"], bn_params(5))
    assert check_pass(model, "fold-batchnorm").counts == {}
    assert "no constant 2-D weight" in near_miss_reasons(model)


def test_no_fold_when_weight_is_shared():
    model = make_model(
        [node("MatMul", ["x", "W"], ["m"]), bn("m", "y"), node("MatMul", ["x", "W"], ["z"])],
        {"x": [3, 6]}, ["y", "z"], {"W": rand(6, 5), **bn_params(5)},
    )
    assert check_pass(model, "fold-batchnorm").counts == {}
    assert "shared" in near_miss_reasons(model)


def small_cnn():
    """Conv-BN-Relu-Conv(no bias)-BN-GlobalAveragePool-Flatten-Gemm-BN."""
    inits = {
        "W1": rand(8, 3, 3, 3, seed=1), "B1": rand(8, seed=2), **bn_params(8, "bn1_"),
        "W2": rand(4, 8, 3, 3, seed=3), **bn_params(4, "bn2_"),
        "W3": rand(4, 6, seed=4), "B3": rand(6, seed=5), **bn_params(6, "bn3_"),
    }
    nodes = [
        node("Conv", ["x", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1]), bn("c1", "n1", "bn1_"),
        node("Relu", ["n1"], ["r1"]),
        node("Conv", ["r1", "W2"], ["c2"]), bn("c2", "n2", "bn2_"),
        node("GlobalAveragePool", ["n2"], ["p"]), node("Flatten", ["p"], ["f"]),
        node("Gemm", ["f", "W3", "B3"], ["g"]), bn("g", "y", "bn3_"),
    ]
    return make_model(nodes, {"x": [2, 3, 8, 8]}, ["y"], inits)


def test_small_cnn_pipeline_folds_every_batchnorm():
    model = small_cnn()
    feeds = random_feeds(model)
    expected = run_ort(model, feeds)
    stats = run_pipeline(
        model, ["fold-constants", "fold-batchnorm", "remove-unused", "cse"], expectations={"fold-batchnorm": {"min": 3}}
    )
    by_name = {s.name: s for s in stats}
    assert by_name["fold-batchnorm"].counts == {"conv": 2, "gemm": 1}
    assert (by_name["fold-batchnorm"].nodes_before, by_name["fold-batchnorm"].nodes_after) == (9, 6)
    assert "BatchNormalization" not in op_counts(model)
    np.testing.assert_allclose(run_ort(model, feeds)[0], expected[0], atol=1e-5, rtol=1e-5)


def test_torch_exported_conv_bn_relu_conv_bn():
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.b1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
            self.c2, self.b2 = torch.nn.Conv2d(8, 4, 3, bias=False), torch.nn.BatchNorm2d(4)

        def forward(self, x):
            return self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))

    torch.manual_seed(0)
    net = Net().eval()
    for norm in (net.b1, net.b2):
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
        norm.weight.data.uniform_(0.5, 2)
        norm.bias.data.uniform_(-1, 1)
    x = torch.randn(2, 3, 8, 8)
    buffer = io.BytesIO()
    # The TorchScript exporter without constant folding keeps the BatchNormalization nodes (and takes ~0.1 s).
    torch.onnx.export(net, (x,), buffer, dynamo=False, do_constant_folding=False, opset_version=18,
                      input_names=["x"], output_names=["y"])
    model = ir.from_proto(onnx.load_from_string(buffer.getvalue()))
    assert op_counts(model)["BatchNormalization"] == 2
    stats = run_pipeline(model, ["fold-batchnorm", "remove-unused"], expectations={"fold-batchnorm": {"min": 2}})
    assert stats[0].counts == {"conv": 2}
    assert op_counts(model) == {"Conv": 2, "Relu": 1}
    with torch.no_grad():
        expected = net(x).numpy()
    np.testing.assert_allclose(run_ort(model, {"x": x.numpy()})[0], expected, atol=1e-4, rtol=1e-4)
