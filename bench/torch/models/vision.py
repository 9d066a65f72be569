"""Vision models trained (torchvision, random init) on random images. A step ends in
shared.finish_training_step unless said otherwise; the held-out batch of each program is in
parentheses (models/__init__.py).

- fasterrcnn: fasterrcnn_resnet50_fpn (weights=None, weights_backbone=None) training, 4 random
  images a step whose sides are drawn from 400..1000 each (the model's transform resizes them to
  a shorter side of 800, so the batch's padded shape changes every step), 1..5 random boxes per
  image, SGD.
- resnet50_train_eval: ResNet-50 trained on 32 images of 224 px (SGD) and evaluated on 64 every
  TRAIN_EVAL_PERIOD steps (shared._train_eval).
- vit (1): ViT-B/16, one shape.
- convnext_multiscale (2): ConvNeXt-T at an image size drawn per step (CONVNEXT_SIZES), fp16 with
  a GradScaler; its own optimizer step.
- prefetch_train (6): ResNet-18 fed by a side stream that copies the next batch in from pinned
  memory.
- gan (6): a DCGAN, generator and discriminator each with its own optimizer, in turn.
- amp_scaler (7): EfficientNet-B0 as AMP recipes train it (GradScaler, unscale, clip); its own
  optimizer step.
- distill (7): a ResNet-50 teacher distilled into a ResNet-18 student (SGD).
- eval_collect (11): FCN-ResNet50 segmentation whose evaluation gathers its outputs on the GPU.
- clip_train (11): CLIP-style contrastive training of an image and a text tower.
"""

import math
import random

from . import shared  # shared.finish_training_step, looked up at each call (host_time.py)
from .shared import _train_eval


def fasterrcnn_step(torch, steps, seed=0, batch=4):
    """Faster R-CNN training steps on random images of random sizes with random boxes."""
    import torchvision

    torch.manual_seed(seed)
    rng = random.Random(seed)
    plan = []  # per step: [(h, w, boxes, labels)] with boxes as [x1, y1, x2, y2] lists
    for _ in range(steps):
        images = []
        for _ in range(batch):
            h, w = rng.randrange(400, 1001), rng.randrange(400, 1001)
            boxes = []
            for _ in range(rng.randint(1, 5)):
                bw, bh = rng.randrange(16, w // 2), rng.randrange(16, h // 2)
                x1, y1 = rng.randrange(0, w - bw), rng.randrange(0, h - bh)
                boxes.append([x1, y1, x1 + bw, y1 + bh])
            images.append((h, w, boxes, [rng.randint(1, 90) for _ in boxes]))
        plan.append(images)
    model = torchvision.models.detection.fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None)
    model.cuda().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9, weight_decay=1e-4)

    def step(i):
        images = [torch.rand(3, h, w, device="cuda") for h, w, _, _ in plan[i]]
        targets = [dict(boxes=torch.tensor(b, dtype=torch.float32, device="cuda"),
                        labels=torch.tensor(l, dtype=torch.int64, device="cuda"))
                   for _, _, b, l in plan[i]]
        losses = model(images, targets)
        loss = sum(losses.values())
        return shared.finish_training_step(optimizer, loss)

    step.shapes = [" ".join("%dx%d" % (h, w) for h, w, _, _ in images) for images in plan]
    return step


def resnet50_train_eval_step(torch, steps, seed=0):
    """torchvision ResNet-50 (random init): train on 32 images of 224 px, evaluate on 64."""
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.resnet50().cuda().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def images(batch):
        return (torch.randn(batch, 3, 224, 224, device="cuda"),
                torch.randint(0, 1000, (batch,), device="cuda"))

    def loss_of(batch):
        x, labels = batch
        return torch.nn.functional.cross_entropy(model(x), labels)

    return _train_eval(torch, model, optimizer, steps, lambda i: images(32),
                       lambda i: images(64), loss_of)


def vit_step(torch, steps, seed=0, batch=64):
    """torchvision ViT-B/16 (random init) training on 224 px images, bf16 autocast, AdamW: one
    shape every step."""
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.vit_b_16().cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        x = torch.randn(batch, 3, 224, 224, device="cuda")
        labels = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), labels)
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["batch %d" % batch] * steps
    return step


CONVNEXT_SIZES = (160, 192, 224, 256, 288)


def convnext_multiscale_step(torch, steps, seed=0, batch=64):
    """torchvision ConvNeXt-T (random init) multi-scale training: channels_last, fp16 autocast
    with a GradScaler, SGD with momentum; each step's image size is drawn from CONVNEXT_SIZES."""
    import torchvision

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = torchvision.models.convnext_tiny().cuda().train().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    sizes = [rng.choice(CONVNEXT_SIZES) for _ in range(steps)]

    def step(i):
        x = torch.randn(batch, 3, sizes[i], sizes[i], device="cuda").to(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step.shapes = ["%d px" % s for s in sizes]
    return step


def prefetch_train_step(torch, steps, seed=0, batch=128, size=160, pinned=4):
    """ResNet-18 (torchvision, random init) training fed as fast loaders feed it: uint8 batches
    in pinned host memory (a ring of 4), each copied to the GPU with non_blocking=True and
    normalized on a side stream one step ahead, the main stream waiting for it and calling
    record_stream on what it takes over (timm's and apex's prefetchers); bf16 autocast,
    channels_last, SGD with momentum."""
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.resnet18(weights=None).cuda().train()
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    host = [torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8).pin_memory()
            for _ in range(pinned)]
    labels_host = [torch.randint(0, 1000, (batch,)).pin_memory() for _ in range(pinned)]
    mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255
    copier = torch.cuda.Stream()
    ahead = {}

    def prefetch(i):
        with torch.cuda.stream(copier):
            x = host[i % pinned].cuda(non_blocking=True)
            y = labels_host[i % pinned].cuda(non_blocking=True)
            x = x.float().sub_(mean).div_(std).contiguous(memory_format=torch.channels_last)
        ahead[i] = (x, y)

    def step(i):
        if i not in ahead:
            prefetch(i)
        main = torch.cuda.current_stream()
        main.wait_stream(copier)
        x, y = ahead.pop(i)
        x.record_stream(main)
        y.record_stream(main)
        prefetch(i + 1)  # the next batch copies while this one trains
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["%d x 3 x %d x %d" % (batch, size, size)] * steps
    return step


def gan_step(torch, steps, seed=0, batch=128, latent=128, size=64):
    """DCGAN at 64 px: a generator and a discriminator trained in turn, each with its own Adam
    (the discriminator's step on real and generated images, then the generator's), so two
    optimizer steps a training step, over different models; fp32, random "real" images."""
    nn = torch.nn
    torch.manual_seed(seed)
    g = nn.Sequential(
        nn.ConvTranspose2d(latent, 512, 4, 1, 0, bias=False), nn.BatchNorm2d(512), nn.ReLU(True),
        nn.ConvTranspose2d(512, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True),
        nn.ConvTranspose2d(256, 128, 4, 2, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(True),
        nn.ConvTranspose2d(128, 64, 4, 2, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(True),
        nn.ConvTranspose2d(64, 3, 4, 2, 1, bias=False), nn.Tanh()).cuda()
    d = nn.Sequential(
        nn.Conv2d(3, 64, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True),
        nn.Conv2d(64, 128, 4, 2, 1, bias=False), nn.BatchNorm2d(128), nn.LeakyReLU(0.2, True),
        nn.Conv2d(128, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.LeakyReLU(0.2, True),
        nn.Conv2d(256, 512, 4, 2, 1, bias=False), nn.BatchNorm2d(512), nn.LeakyReLU(0.2, True),
        nn.Conv2d(512, 1, 4, 1, 0, bias=False), nn.Flatten()).cuda()
    opt_g = torch.optim.Adam(g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    ones = torch.ones(batch, 1, device="cuda")
    zeros = torch.zeros(batch, 1, device="cuda")

    def step(i):
        real = torch.rand(batch, 3, size, size, device="cuda") * 2 - 1
        fake = g(torch.randn(batch, latent, 1, 1, device="cuda"))
        loss_d = bce(d(real), ones) + bce(d(fake.detach()), zeros)
        loss_d.backward()
        opt_d.step()
        opt_d.zero_grad(set_to_none=True)
        loss_g = bce(d(fake), ones)
        loss_g.backward()
        opt_g.step()
        opt_g.zero_grad(set_to_none=True)
        d.zero_grad(set_to_none=True)  # the generator's backward also filled d's gradients
        return loss_d.item() + loss_g.item()

    step.shapes = ["%d x %d px" % (batch, size)] * steps
    return step


def amp_scaler_step(torch, steps, seed=0, batch=96, size=224):
    """torchvision EfficientNet-B0 (random init) trained as AMP recipes do: fp16 autocast,
    torch.amp.GradScaler, gradients unscaled and clipped (clip_grad_norm_ at 1.0) before the
    scaler's step, fused AdamW, channels_last; one shape every step."""
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.efficientnet_b0().cuda().train()
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")

    def step(i):
        x = torch.randn(batch, 3, size, size, device="cuda")
        x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step.shapes = ["%d x %d px" % (batch, size)] * steps
    return step


def distill_step(torch, steps, seed=0, batch=128, size=192, temperature=4.0):
    """Knowledge distillation: a ResNet-50 teacher (torchvision, random init, eval mode, under
    torch.no_grad) and a ResNet-18 student trained on the teacher's softened outputs (KL
    divergence at temperature 4) plus the labels; bf16 autocast, SGD with momentum; one shape
    every step."""
    import torchvision

    F = torch.nn.functional
    torch.manual_seed(seed)
    teacher = torchvision.models.resnet50().cuda().eval()
    student = torchvision.models.resnet18().cuda().train()
    optimizer = torch.optim.SGD(student.parameters(), lr=0.05, momentum=0.9)

    def step(i):
        x = torch.randn(batch, 3, size, size, device="cuda")
        y = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.no_grad():
                soft = F.softmax(teacher(x).float() / temperature, dim=1)
            logits = student(x).float()
            kl = F.kl_div(F.log_softmax(logits / temperature, dim=1), soft,
                          reduction="batchmean")
            loss = kl * temperature ** 2 + F.cross_entropy(logits, y)
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d px" % (batch, size)] * steps
    return step


def eval_collect_step(torch, steps, seed=0, batch=8, size=320, every=4, eval_batches=16):
    """Segmentation training with an evaluation that gathers its outputs on the GPU, as many
    scripts compute a dataset's metric: torchvision FCN-ResNet50 (random init, 21 classes) trained
    on batches of 8 random 320 px images (SGD, bf16 autocast); every 4th step is instead an
    evaluation of 16 batches under torch.no_grad whose logits and labels are appended to lists
    on the GPU, concatenated at the end for the confusion matrix and mean IoU, then dropped."""
    import torchvision

    torch.manual_seed(seed)
    classes = 21
    model = torchvision.models.segmentation.fcn_resnet50(
        weights=None, weights_backbone=None, num_classes=classes, aux_loss=False).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def images():
        return (torch.randn(batch, 3, size, size, device="cuda"),
                torch.randint(0, classes, (batch, size, size), device="cuda"))

    def step(i):
        if i % every != every - 1:
            model.train()
            x, y = images()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x)["out"], y)
            return shared.finish_training_step(optimizer, loss)
        model.eval()
        outputs, labels = [], []
        with torch.no_grad():
            for _ in range(eval_batches):
                x, y = images()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    outputs.append(model(x)["out"].float())
                labels.append(y)
            predicted = torch.cat(outputs).argmax(1)
            truth = torch.cat(labels)
            confusion = torch.bincount(truth.flatten() * classes + predicted.flatten(),
                                       minlength=classes * classes).view(classes, classes)
            union = confusion.sum(0) + confusion.sum(1) - confusion.diag()
            return (confusion.diag() / union.clamp(min=1)).mean().item()

    step.shapes = ["eval" if i % every == every - 1 else "train" for i in range(steps)]
    return step


def clip_train_step(torch, steps, seed=0, batch=128, size=160, tokens=77):
    """CLIP-style contrastive training of two towers: a ViT-B/16 image tower (torchvision, 160 px,
    its head a 512-wide projection) and a 12-layer text Transformer (512 wide, 8 heads,
    pre-norm, 77 tokens, its last token projected), the batch's image-text similarity matrix with
    a learned temperature and the symmetric cross entropy; bf16 autocast, AdamW."""
    import torchvision

    torch.manual_seed(seed)
    nn = torch.nn
    width, vocab = 512, 49408
    image_tower = torchvision.models.vit_b_16(weights=None, image_size=size, num_classes=width)
    text_layer = nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True,
                                            norm_first=True, activation="gelu")
    text = nn.ModuleDict(dict(
        embed=nn.Embedding(vocab, width), blocks=nn.TransformerEncoder(
            text_layer, 12, enable_nested_tensor=False), norm=nn.LayerNorm(width),
        project=nn.Linear(width, width, bias=False)))
    positions = nn.Parameter(torch.randn(tokens, width, device="cuda") * 0.01)
    scale = nn.Parameter(torch.tensor(math.log(1 / 0.07), device="cuda"))
    model = nn.ModuleDict(dict(image=image_tower, text=text)).cuda()
    params = list(model.parameters()) + [positions, scale]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    causal = nn.Transformer.generate_square_subsequent_mask(tokens, device="cuda")

    def step(i):
        x = torch.randn(batch, 3, size, size, device="cuda")
        ids = torch.randint(0, vocab, (batch, tokens), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            image = torch.nn.functional.normalize(model["image"](x), dim=-1)
            t = text["blocks"](text["embed"](ids) + positions, mask=causal, is_causal=True)
            t = torch.nn.functional.normalize(text["project"](text["norm"](t[:, -1])), dim=-1)
            logits = scale.exp() * image @ t.t()
            target = torch.arange(batch, device="cuda")
            loss = (torch.nn.functional.cross_entropy(logits, target) +
                    torch.nn.functional.cross_entropy(logits.t(), target)) / 2
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d px + %d tokens" % (batch, size, tokens)] * steps
    return step
