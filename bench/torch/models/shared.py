"""What the workloads' steps share: finish_training_step, the end of every training step that
does not end its own way, and the loop and builders that several families use.

finish_training_step is one function for every factory, called as `shared.finish_training_step`
in the other modules (here, as this module's global): looked up at each call, never bound by
`from .shared import finish_training_step`. host_time.py replaces it here
(`models.shared.finish_training_step = ...`) to take the host sync out of every program's step.
Its `optimizer.step()` is where gmem.torch marks steps, and where a replay marks the steps of a
trace captured from this package (models.step_frame).

- _train_eval: training with an evaluation every TRAIN_EVAL_PERIOD steps, the loop most programs
  run: three training steps, then an evaluation step (two batches of another shape under
  torch.no_grad in eval mode), and again; the two phases take turns over the same model
  (gpt2_train_eval in language.py, resnet50_train_eval in vision.py).
- _bf16_on_gpu: a module built with bf16 parameters on the GPU directly, as
  from_pretrained(torch_dtype=torch.bfloat16) loads a checkpoint (no fp32 copy first).
- _causal_lm_steps: training steps of a transformers causal LM, compiled or not, on random tokens
  (lora_llama, gpt2_compiled, gpt2_dynamic).
"""


def finish_training_step(optimizer, loss):
    """The end of every training step here: backward, the optimizer's step, the gradients set
    to None; returns the loss as a float (a host sync, as a training loop's logging makes)."""
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


# Training with an evaluation every TRAIN_EVAL_PERIOD steps: step i evaluates when
# i % TRAIN_EVAL_PERIOD == TRAIN_EVAL_PERIOD - 1, and trains otherwise.
TRAIN_EVAL_PERIOD = 4


def _train_eval(torch, model, optimizer, steps, train_batch, eval_batch, loss_of):
    """step(i) for a loop that trains and evaluates in turn; `train_batch(i)` and `eval_batch(i)`
    make an input on the GPU, `loss_of(batch)` runs the model on it."""

    def step(i):
        if i % TRAIN_EVAL_PERIOD == TRAIN_EVAL_PERIOD - 1:
            model.eval()
            total = 0.0
            with torch.no_grad():
                for k in range(2):
                    total += loss_of(eval_batch(2 * i + k)).item()
            model.train()
            return total / 2
        loss = loss_of(train_batch(i))
        return finish_training_step(optimizer, loss)

    step.shapes = ["eval" if i % TRAIN_EVAL_PERIOD == TRAIN_EVAL_PERIOD - 1 else "train"
                   for i in range(steps)]
    return step


def _bf16_on_gpu(torch, build):
    """Builds a module with bf16 parameters on the GPU directly (as a checkpoint is loaded)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return build().eval()
    finally:
        torch.set_default_dtype(dtype)


def _causal_lm_steps(torch, model, vocab_size, optimizer, batch, lengths):
    """Training steps of a transformers causal LM (`model`, compiled or not) on random tokens:
    step i is batch x lengths[i] under bf16 autocast, the labels the inputs (the model shifts
    them), then finish_training_step."""

    def step(i):
        ids = torch.randint(0, vocab_size, (batch, lengths[i]), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        return finish_training_step(optimizer, loss)

    step.shapes = ["%d x %d" % (batch, t) for t in lengths]
    return step
