/* gmem's C API for observability: tracking, scopes, steps, snapshots and OOM reports.
 *
 * Tracking is off until gmem_tracking_enable(): then every allocation is recorded with its size,
 * stream, time, step, scope and call site, and a bounded history of events is kept, at a cost of
 * a few tens of nanoseconds per malloc+free. Scopes and call sites are per thread and apply to
 * every device. Snapshots and OOM reports work without tracking too, with less detail.
 *
 * Conventions as in gmem.h: gmem_status_t results, gmem_last_error() for the message, device -1
 * for the calling thread's current device. Text results go into (buf, size) like
 * gmem_stats_text: NUL-terminated, truncated to fit, and *needed (when not NULL) gets the full
 * size including the NUL, so a caller can retry with a larger buffer (a snapshot is taken anew on
 * each call and may have grown by then). */
#ifndef GMEM_GMEM_OBSERVE_H
#define GMEM_GMEM_OBSERVE_H

#include <stddef.h>

#include "gmem/gmem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Starts tracking `device`'s allocations. history_capacity: events kept (0 = the default,
 * 131072, 56 bytes each: 7 MiB); stacks: where each allocation's call site comes from,
 *   GMEM_STACKS_THREAD (0)  the thread's frames set with gmem_set_frames (and scopes),
 *   GMEM_STACKS_CPP (1)     a C++ backtrace per allocation (about 1-10 us each),
 *   GMEM_STACKS_PYTHON (2)  the allocating thread's Python stack, read from C++ (the GIL is taken
 *                           for the walk; a stack seen before costs no strings); threads without
 *                           Python, and processes without it, fall back to the thread's frames.
 * Enabling again changes nothing. Allocations made before remain untracked (snapshots list them
 * without call sites). */
enum { GMEM_STACKS_THREAD = 0, GMEM_STACKS_CPP = 1, GMEM_STACKS_PYTHON = 2 };
gmem_status_t gmem_tracking_enable(int device, size_t history_capacity, int stacks);
/* Python files whose path starts with `prefix` are left out of captured Python stacks (the
 * Python package passes its own folder). NULL or "" leaves none out. */
gmem_status_t gmem_python_stacks_skip(const char* prefix);
/* Stops recording. Queries (snapshots, OOM reports, summaries by site) then answer as without
 * tracking: what was recorded is no longer read. */
gmem_status_t gmem_tracking_disable(int device);
/* 1 when `device` is tracked, 0 when not, -1 on error. */
int gmem_tracking_enabled(int device);

/* Scopes of the calling thread: allocations made inside are tagged with the scope path
 * ("train/forward"). push_module enters a dotted module path that replaces an enclosing module
 * scope instead of nesting in it. pop_to leaves scopes until `depth` remain. */
gmem_status_t gmem_scope_push(const char* name);
gmem_status_t gmem_scope_push_module(const char* module_path);
gmem_status_t gmem_scope_pop(void);
size_t gmem_scope_depth(void);
gmem_status_t gmem_scope_pop_to(size_t depth);

/* The calling thread's call site for the allocations it makes next: "file:line:function" lines,
 * innermost first (the Python layer sets its stack here). NULL or "" clears it. */
gmem_status_t gmem_set_frames(const char* frames);
/* The calling thread's call site as an opaque id (0: none), to put back later with
 * gmem_restore_frames (hooks that set frames for a call restore the caller's afterwards). */
uint32_t gmem_current_frames(void);
gmem_status_t gmem_restore_frames(uint32_t id);

/* A training step ended (leak detection samples at steps), or a note for the history; both go to
 * every tracked device. */
gmem_status_t gmem_step(void);
gmem_status_t gmem_annotate(const char* text);

/* Autograd graphs (PyTorch's saved-tensor hooks call these; gmem.torch.track_graphs()). The block
 * that starts at `ptr` holds a tensor saved for a backward pass (saved = 1), or the backward pass
 * has used it (saved = 0); its device is the one whose engine handed it out. Returns 1 when `ptr`
 * is a tracked block, 0 when it is not (host memory, another allocator's, an untracked device, a
 * block allocated before tracking), -1 on error; nothing is created for a pointer gmem does not
 * know. Leak detection reports a saved block that is still live steps later as a graph kept
 * alive. gmem_graph_backward: a backward pass ran (any device); OOM reports and gmem_leaks then
 * advise .item()/.detach() for a kept graph instead of torch.no_grad(). */
int gmem_graph_saved(const void* ptr, int saved);
gmem_status_t gmem_graph_backward(void);

/* A snapshot of `device` now: gmem's JSON (docs/snapshot-schema.md), or the pickle that
 * torch.cuda.memory._dump_snapshot writes (open it at https://pytorch.org/memory_viz). */
gmem_status_t gmem_snapshot_json(int device, char* buf, size_t size, size_t* needed);
gmem_status_t gmem_snapshot_pickle(int device, const char* path);

/* The report of the last failed allocation, as text or JSON ("" when none failed). Here device
 * -1 means the most recent failure on any device. The report is also appended to the message
 * of the failed call (gmem_last_error) unless the environment sets GMEM_OOM_REPORT=0. */
gmem_status_t gmem_oom_report_text(int device, char* buf, size_t size, size_t* needed);
gmem_status_t gmem_oom_report_json(int device, char* buf, size_t size, size_t* needed);

/* The leak findings so far on `device`: the sites whose memory kept across steps (gmem_step)
 * grows step after step, with the cause decided as in OOM reports, as `gmem leaks` prints them or
 * as its JSON (plus "text": the same report as text, from the same findings). Times count from
 * when tracking began. Fails with GMEM_ERROR_INVALID_ARGUMENT when `device` is not tracked. */
gmem_status_t gmem_leaks_text(int device, char* buf, size_t size, size_t* needed);
gmem_status_t gmem_leaks_json(int device, char* buf, size_t size, size_t* needed);

/* The `n` call sites holding the most live memory on `device`, most first, as the summary and
 * OOM reports name them (a stack's innermost frame in the user's own code):
 * [{"site": "train.py:42:forward", "bytes": 1048576, "count": 3}, ...]; [] when untracked. */
gmem_status_t gmem_top_sites_json(int device, size_t n, char* buf, size_t size, size_t* needed);

/* The live blocks on `device`, for the Python layer's holder search (gmem.holders):
 * {"tracked": true, "step": N, "blocks": [{"address", "size", "step", "site",
 * "saved_for_backward"}]}, only those whose site (as leak findings name it) is `site` unless it
 * is NULL or ""; untracked: {"tracked": false, "blocks": [{"address", "size"}]} (all of them). */
gmem_status_t gmem_live_blocks_json(int device, const char* site, char* buf, size_t size,
                                    size_t* needed);

#ifdef __cplusplus
}
#endif

#endif /* GMEM_GMEM_OBSERVE_H */
