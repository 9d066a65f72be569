"""Training on sparse, irregular inputs, whose block sizes are drawn anew every step (held-out
batch 5, models/__init__.py).

- gnn_random: a graph network of three GCN-style layers on a random graph a step (20k..200k
  nodes, 4..16 edges a node), messages summed along the edges with index_add_: no two steps share
  a shape (shared.finish_training_step).
- dlrm_sparse: a recommendation model of DLRM's form, 8 EmbeddingBag tables of 1M x 64 with sparse
  gradients (SGD) and MLPs (AdamW): two optimizers, its own optimizer steps.
"""

import random

from . import shared  # shared.finish_training_step, looked up at each call (host_time.py)


def gnn_random_step(torch, steps, seed=0, features=256, hidden=512, layers=3, classes=40):
    """A graph network of three GCN-style layers (Linear, then messages gathered along the edges
    and summed into their targets with index_add_, divided by the in-degree, ReLU) trained with
    AdamW under bf16 autocast on a random graph a step: 20k..200k nodes of 256 features, 4..16
    edges a node. No two steps share a shape, as when training on sampled subgraphs."""
    nn = torch.nn
    torch.manual_seed(seed)
    rng = random.Random(seed)

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            dims = [features] + [hidden] * (layers - 1) + [classes]
            self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

        def forward(self, x, src, dst, norm):
            for k, lin in enumerate(self.lins):
                x = lin(x)
                x = torch.zeros_like(x).index_add_(0, dst, x[src]) * norm[:, None]
                if k < len(self.lins) - 1:
                    x = torch.relu(x)
            return x

    model = GCN().cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graphs = [(rng.randint(20000, 200000), rng.randint(4, 16)) for _ in range(steps)]

    def step(i):
        nodes, degree = graphs[i]
        x = torch.randn(nodes, features, device="cuda")
        src = torch.randint(0, nodes, (nodes * degree,), device="cuda")
        dst = torch.randint(0, nodes, (nodes * degree,), device="cuda")
        norm = torch.bincount(dst, minlength=nodes).clamp(min=1).float().reciprocal()
        labels = torch.randint(0, classes, (nodes,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, src, dst, norm)
        loss = torch.nn.functional.cross_entropy(out.float(), labels)
        return shared.finish_training_step(optimizer, loss)

    step.shapes = ["%d nodes x %d edges" % (n, n * d) for n, d in graphs]
    return step


def dlrm_sparse_step(torch, steps, seed=0, batch=16384, tables=8, rows=1000000, dim=64):
    """A recommendation model of DLRM's form: 8 tables of 1M x 64 (fp32, 2 GiB in all) read
    by EmbeddingBag(mode="sum", sparse=True) over bags of 1..60 random ids a sample, a bottom
    MLP over 13 dense features, the pairwise dot products of the 9 vectors, a top MLP; batch
    16,384. Two optimizers, as DLRM trains: SGD on the tables' sparse gradients (sized by the
    ids drawn, so different every step) and AdamW on the MLPs."""
    nn = torch.nn
    torch.manual_seed(seed)

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
                                        for _ in range(tables))
            self.bottom = nn.Sequential(nn.Linear(13, 512), nn.ReLU(), nn.Linear(512, 256),
                                        nn.ReLU(), nn.Linear(256, dim), nn.ReLU())
            pairs = (tables + 1) * tables // 2
            self.top = nn.Sequential(nn.Linear(dim + pairs, 1024), nn.ReLU(),
                                     nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))

        def forward(self, dense, bags):
            x = self.bottom(dense)
            z = torch.stack([x] + [t(ids, offsets) for t, (ids, offsets) in zip(self.tables, bags)],
                            dim=1)
            dots = torch.bmm(z, z.transpose(1, 2))
            li, lj = torch.tril_indices(tables + 1, tables + 1, offset=-1, device=z.device)
            return self.top(torch.cat([x, dots[:, li, lj]], dim=1)).squeeze(1)

    with torch.device("cuda"):
        model = DLRM().train()
    sparse = torch.optim.SGD(model.tables.parameters(), lr=0.01)
    dense = torch.optim.AdamW(list(model.bottom.parameters()) + list(model.top.parameters()),
                              lr=1e-3)

    def step(i):
        bags = []
        for _ in range(tables):
            lengths = torch.randint(1, 61, (batch,), device="cuda")
            offsets = torch.cumsum(lengths, 0) - lengths
            bags.append((torch.randint(0, rows, (int(lengths.sum()),), device="cuda"), offsets))
        dense_x = torch.randn(batch, 13, device="cuda")
        labels = torch.randint(0, 2, (batch,), device="cuda").float()
        loss = nn.functional.binary_cross_entropy_with_logits(model(dense_x, bags), labels)
        loss.backward()
        sparse.step()
        dense.step()
        sparse.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
        return loss.item()

    step.shapes = ["batch %d, bags of 1..60" % batch] * steps
    return step
