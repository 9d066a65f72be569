"""A Lightning callback that finds the largest batch size by measurement, in place of
BatchSizeFinder:

    import lightning.pytorch as pl
    from gmem.lightning import FitBatchSize

    trainer = pl.Trainer(callbacks=[FitBatchSize()], precision="bf16-mixed")
    trainer.fit(model, datamodule)   # model.batch_size (or datamodule's) set before training

Run it under gmem (`python -m gmem.run train.py`, or gmem.torch.enable() first). At fit start
it runs gmem.fit_batch_size over the module's own training_step, under the trainer's precision
and strategy (so under DDP every rank probes, and all take the smallest pick), sets the batch
size on the module or datamodule as Lightning's tuner does, and puts the weights and optimizer
state back as they were. The result is kept as `callback.fit`.
"""

from .fit import fit_batch_size

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr
    _MISSING = None
except ImportError:
    try:  # the older package name
        from pytorch_lightning.callbacks import Callback
        from pytorch_lightning.utilities.parsing import lightning_getattr, lightning_setattr
        _MISSING = None
    except ImportError as e:
        # The module still imports (its docs and names stay readable); the callback says what
        # to install when it is made.
        _MISSING = str(e)

        class Callback:
            def __init__(self, *args, **kwargs):
                raise ImportError("gmem.lightning.FitBatchSize needs Lightning (the lightning or "
                                  "pytorch_lightning package), which cannot be imported: %s"
                                  % _MISSING)


class FitBatchSize(Callback):
    """Sets `batch_arg_name` (on the LightningModule, its hparams or the datamodule, as
    Lightning's tuner finds it) to the largest batch size that fits, found by measurement.

    max_batch_size  never above this; limit: the memory to fit in (fit_batch_size's)
    verbose         print the fit's table on rank 0
    Other keyword arguments go to gmem.fit_batch_size."""

    def __init__(self, batch_arg_name="batch_size", max_batch_size=None, limit=None,
                 verbose=True, **fit_options):
        super().__init__()
        self.batch_arg_name = batch_arg_name
        self.max_batch_size = max_batch_size
        self.limit = limit
        self.verbose = verbose
        self.fit_options = fit_options
        self.fit = None

    def on_fit_start(self, trainer, pl_module):
        lightning_getattr(pl_module, self.batch_arg_name)  # fails early, naming the attribute
        step = _TrainingStep(trainer, pl_module, self.batch_arg_name)
        optimizers = list(trainer.optimizers)
        with step:
            self.fit = fit_batch_size(step, limit=self.limit, max_batch_size=self.max_batch_size,
                                      restore=[pl_module] + optimizers, **self.fit_options)
        lightning_setattr(pl_module, self.batch_arg_name, self.fit.batch_size)
        if self.verbose and trainer.is_global_zero:
            print(self.fit)


class _TrainingStep:
    """One training step of a LightningModule at a batch size, outside Lightning's loop: the
    batch from a fresh train dataloader, training_step under the strategy (precision context,
    DDP wrapper), backward through the strategy, the optimizer step. self.log() is muted, since
    no loop collects what it logs."""

    def __init__(self, trainer, module, batch_arg_name):
        self.trainer, self.module, self.batch_arg_name = trainer, module, batch_arg_name
        self._log = None

    def __enter__(self):
        self._log = self.module.__dict__.get("log")
        self._log_dict = self.module.__dict__.get("log_dict")
        self.module.log = lambda *args, **kwargs: None
        self.module.log_dict = lambda *args, **kwargs: None
        return self

    def __exit__(self, *exc):
        for name, saved in (("log", self._log), ("log_dict", self._log_dict)):
            if saved is None:
                del self.module.__dict__[name]
            else:
                self.module.__dict__[name] = saved
        return False

    def _batch(self, batch_size):
        lightning_setattr(self.module, self.batch_arg_name, batch_size)
        source = self.trainer.datamodule if self.trainer.datamodule is not None else self.module
        loader = source.train_dataloader()
        batch = next(iter(loader))
        return self.trainer.strategy.batch_to_device(batch)

    def __call__(self, batch_size):
        trainer = self.trainer
        batch = self._batch(batch_size)
        optimizer = trainer.optimizers[0]
        output = trainer.strategy.training_step(batch, 0)
        loss = output["loss"] if isinstance(output, dict) else output
        trainer.strategy.backward(loss, optimizer)
        del output, loss, batch
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
