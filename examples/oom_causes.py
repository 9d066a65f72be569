"""The four classic ways to run out of GPU memory, each run to its OOM under gmem, printing gmem's
OOM report. README's "Why did it run out of memory?" shows their reports from an H100.

    python examples/oom_causes.py inference_leak    # inference without no_grad, outputs kept
    python examples/oom_causes.py kept_loss         # validation losses kept with their graphs
    python examples/oom_causes.py batch_too_large   # a batch that does not fit
    python examples/oom_causes.py fragmentation     # free memory in pieces too small to use
    python examples/oom_causes.py CASE --json       # the report as JSON (the tests read it)

Each runs under a memory limit (3 GiB unless said) so that it fails within seconds on any GPU.
Needs PyTorch with CUDA, and torchvision for the first three.
"""

import argparse
import json
import sys

import gmem
import gmem.torch

GiB = 1 << 30


def inference_leak(torch, torchvision):
    # A conv net run on one 300x300 image at a time, without torch.no_grad(), each output kept:
    # every output holds its autograd graph, and the graph holds the activations.
    model = torchvision.models.resnet18(num_classes=10).cuda().eval()
    gmem.torch.watch(model)
    outputs = []
    for _ in range(10_000):
        image = torch.randn(1, 3, 300, 300, device="cuda")
        outputs.append(model(image))


def kept_loss(torch, torchvision):
    # Training with a validation loss each step, kept in a list without .item(): the training
    # graphs are freed by backward, the validation graphs are kept with their losses.
    model = torchvision.models.resnet18(num_classes=10).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gmem.torch.watch(optimizer)
    loss_fn = torch.nn.CrossEntropyLoss()
    val_losses = []
    for _ in range(10_000):
        images = torch.randn(8, 3, 224, 224, device="cuda")
        labels = torch.randint(0, 10, (8,), device="cuda")
        loss_fn(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        val_images = torch.randn(8, 3, 224, 224, device="cuda")
        val_losses.append(loss_fn(model(val_images), labels))  # should be .item()


def batch_too_large(torch, torchvision):
    # ResNet-50 training at batch 256: its activations need several times the limit.
    model = torchvision.models.resnet50().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gmem.torch.watch(optimizer)
    images = torch.randn(256, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 1000, (256,), device="cuda")
    for _ in range(10):
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def fragmentation(torch, torchvision):
    # 1,024 feature tensors of 1.5 MiB made once, every other one kept: 0.75 GiB live, but every
    # 2 MiB page still holds part of a kept tensor. A 1.25 GiB buffer then fits under the limit
    # by the numbers (0.75 + 1.25 < 2.5 GiB) but finds no whole free pages to use.
    features = [torch.empty(393_216, device="cuda") for _ in range(1024)]
    kept = features[::2]
    del features
    gmem.step()
    gmem.step()
    workspace = torch.empty(1_250 << 18, device="cuda")  # 1.25 GiB of float32
    return kept, workspace


CASES = {"inference_leak": (inference_leak, 3 * GiB), "kept_loss": (kept_loss, 3 * GiB),
         "batch_too_large": (batch_too_large, 3 * GiB),
         "fragmentation": (fragmentation, 5 * GiB // 2)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    gmem.torch.enable()
    import torch
    torchvision = None
    if args.case != "fragmentation":
        import torchvision
    run, limit = CASES[args.case]
    gmem.set_memory_limit(limit)
    gmem.enable_tracking()
    try:
        run(torch, torchvision)
    except torch.OutOfMemoryError:
        report = gmem.last_oom_report(as_json=args.json)
        print(json.dumps(report) if args.json else report)
        return 0
    print("%s: no out-of-memory error" % args.case, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
