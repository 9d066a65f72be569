#!/usr/bin/env bash
# bench/torch/held_frees_ab.sh BASE_DIR (GPU machine, repository root; results under $OUT): the
# programs whose side stream's blocks the compute stream holds (record_stream: streamed weights,
# a prefetched batch), A/B against BASE_DIR (ab.sh). docs/notes/2026-11-25-frees-held-for-other-streams-are-stamped-when-freed.md.
exec "$(dirname "$0")/ab.sh" "$1" weights_stream_serve prefetch_train
