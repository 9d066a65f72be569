"""A DDPM-style noise-prediction UNet in plain torch (_unet), trained and sampled; the held-out
batch of each program is in parentheses (models/__init__.py).

- unet (2): DDPM training on random 64 px images, bf16 autocast, AdamW
  (shared.finish_training_step).
- diffusion_sample (4): sampling as a server of image requests runs it: a resolution drawn per
  request, classifier-free guidance, bf16, under torch.inference_mode.
- ema_train (9): unet's training as diffusers' scripts run it: fused AdamW, gradients clipped, an
  EMA of the weights updated by torch._foreach_lerp_; its own optimizer step.
"""

import math
import random

from . import shared  # shared.finish_training_step, looked up at each call (host_time.py)
from .shared import _bf16_on_gpu


def _unet(torch, channels=(128, 256, 256, 512), attention_at=(2, 3), groups=32):
    """A DDPM-style noise-prediction UNet in plain torch: two residual blocks per level (GroupNorm,
    SiLU, 3x3 convolutions, the timestep's embedding added), self-attention at the lower levels,
    strided convolutions down, nearest upsampling and skip connections up."""
    nn, F = torch.nn, torch.nn.functional

    class Res(nn.Module):
        def __init__(self, cin, cout, tdim):
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(groups, cin), nn.Conv2d(cin, cout, 3, padding=1)
            self.t = nn.Linear(tdim, cout)
            self.n2, self.c2 = nn.GroupNorm(groups, cout), nn.Conv2d(cout, cout, 3, padding=1)
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x, t):
            h = self.c1(F.silu(self.n1(x))) + self.t(t)[:, :, None, None]
            return self.skip(x) + self.c2(F.silu(self.n2(h)))

    class Attention(nn.Module):
        def __init__(self, c, heads=8):
            super().__init__()
            self.norm, self.qkv, self.out, self.heads = nn.GroupNorm(groups, c), nn.Linear(c, 3 * c), nn.Linear(c, c), heads

        def forward(self, x):
            b, c, hh, ww = x.shape
            h = self.norm(x).flatten(2).transpose(1, 2)
            q, k, v = self.qkv(h).view(b, hh * ww, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, hh * ww, c)
            return x + self.out(h).transpose(1, 2).reshape(b, c, hh, ww)

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            tdim = channels[0] * 4
            self.temb = nn.Sequential(nn.Linear(channels[0], tdim), nn.SiLU(), nn.Linear(tdim, tdim))
            self.inp = nn.Conv2d(3, channels[0], 3, padding=1)
            self.down, self.up = nn.ModuleList(), nn.ModuleList()
            skips, c = [channels[0]], channels[0]
            for level, cout in enumerate(channels):
                for _ in range(2):
                    self.down.append(nn.ModuleList([Res(c, cout, tdim),
                                                    Attention(cout) if level in attention_at else nn.Identity()]))
                    c = cout
                    skips.append(c)
                if level < len(channels) - 1:
                    self.down.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
                    skips.append(c)
            self.mid = nn.ModuleList([Res(c, c, tdim), Attention(c), Res(c, c, tdim)])
            for level, cout in reversed(list(enumerate(channels))):
                for _ in range(3):
                    self.up.append(nn.ModuleList([Res(c + skips.pop(), cout, tdim),
                                                  Attention(cout) if level in attention_at else nn.Identity()]))
                    c = cout
                if level > 0:
                    self.up.append(nn.Upsample(scale_factor=2, mode="nearest"))
            self.out = nn.Sequential(nn.GroupNorm(groups, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

        def forward(self, x, t):
            half = channels[0] // 2
            freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=x.device) / half)
            t = self.temb(torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], 1))
            h = self.inp(x)
            hs = [h]
            for m in self.down:
                h = m(h) if isinstance(m, nn.Conv2d) else m[1](m[0](h, t))
                hs.append(h)
            h = self.mid[2](self.mid[1](self.mid[0](h, t)), t)
            for m in self.up:
                h = m(h) if isinstance(m, nn.Upsample) else m[1](m[0](torch.cat([h, hs.pop()], 1), t))
            return self.out(h)

    return UNet()


def unet_step(torch, steps, seed=0, batch=48, size=64):
    """DDPM training of _unet() on random 64 px images: a random timestep per
    image, noise added by a cosine schedule, MSE on the noise; bf16 autocast, AdamW. One shape."""
    torch.manual_seed(seed)
    model = _unet(torch).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        x = torch.randn(batch, 3, size, size, device="cuda")
        t = torch.randint(0, 1000, (batch,), device="cuda").float()
        noise = torch.randn_like(x)
        a = torch.cos(t / 1000 * math.pi / 2)[:, None, None, None]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(a * x + (1 - a * a).sqrt() * noise, t), noise)
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["batch %d x %d px" % (batch, size)] * steps
    return step


def diffusion_sample_step(torch, steps, seed=0, iterations=12):
    """Sampling from _unet() (random init, bf16) as a server of image requests runs it: each
    step is a request of 1..8 images at a resolution drawn from 32..128 px (multiples of 16),
    with classifier-free guidance (the batch doubled), `iterations` denoising steps of a DDIM-like
    update, under torch.inference_mode and bf16 autocast."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = _bf16_on_gpu(torch, lambda: _unet(torch))
    requests = [(rng.randint(1, 8), rng.randrange(32, 129, 16)) for _ in range(steps)]

    def step(i):
        images, size = requests[i]
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            x = torch.randn(images, 3, size, size, device="cuda", dtype=torch.bfloat16)
            for k in range(iterations, 0, -1):
                t = torch.full((2 * images,), k * 1000.0 / iterations, device="cuda")
                both = model(torch.cat([x, x]), t)
                uncond, cond = both.chunk(2)
                eps = uncond + 7.5 * (cond - uncond)
                a = math.cos(k / iterations * math.pi / 2)
                x = (x - math.sqrt(max(1 - a * a, 0.0)) * eps * 0.1).clamp(-3, 3)
            return x.float().mean().item()

    step.shapes = ["%d x %d px" % r for r in requests]
    return step


def ema_train_step(torch, steps, seed=0, batch=48, size=64, decay=0.999):
    """Diffusion training as diffusers' scripts run it: the DDPM training of unet_step with a
    fused AdamW (fused=True), gradients clipped with clip_grad_norm_ (foreach), and an EMA copy
    of the weights updated after every optimizer step with torch._foreach_lerp_ over all
    parameters at once (diffusers' EMAModel with foreach); bf16 autocast, one shape."""
    torch.manual_seed(seed)
    model = _unet(torch).cuda().train()
    ema = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def step(i):
        x = torch.randn(batch, 3, size, size, device="cuda")
        t = torch.randint(0, 1000, (batch,), device="cuda").float()
        noise = torch.randn_like(x)
        a = torch.cos(t / 1000 * math.pi / 2)[:, None, None, None]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(a * x + (1 - a * a).sqrt() * noise, t), noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)
        return loss.item()

    step.shapes = ["batch %d x %d px" % (batch, size)] * steps
    return step
