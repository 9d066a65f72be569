// The engine's behaviour on the simulated device (engine_test.cpp): streams, memory handed
// over between them, held frees (record_stream), stitching and stealing across streams.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <vector>

#include "gmem/engine.hpp"
#include "gmem/sim_device.hpp"
#include "engine_test_support.hpp"
#include "sim_calls.hpp"

namespace gmem {
namespace {

// Stream `a` frees 48 MiB of a 64 MiB device while a kernel of its own may still use them (the
// device's streams complete only when told): a malloc of more than 16 MiB on another stream
// needs those pages. Returns the kernel's work item (SimStreams::ordered_after).
std::uint64_t free_while_its_kernel_runs(SimulatedDevice& device, Engine& engine, StreamId a) {
  void* p = engine.malloc(48 * MiB, a);
  device.streams().submit_work(a);
  const std::uint64_t kernel = device.streams().submitted(a);
  engine.free(p);
  return kernel;
}

// Memory a stream freed while its kernel may still use it goes to another stream only once
// that stream's work comes after the kernel: here it is handed over, the taker made to wait on
// the GPU (cuStreamWaitEvent), with no host wait and no new memory.
TEST(Engine, OtherStreamTakesMemoryOnlyOnceItsWorkComesAfterTheFreeingStream) {
  SimulatedDevice device(device_of(64 * MiB, /*immediate=*/false));
  Engine engine(device);
  constexpr StreamId a = 1, b = 2;
  const std::uint64_t kernel = free_while_its_kernel_runs(device, engine, a);
  EXPECT_FALSE(device.streams().ordered_after(b, a, kernel));
  void* q = engine.malloc(56 * MiB, b);  // more than the device has left: a's pages are needed
  EXPECT_TRUE(device.streams().ordered_after(b, a, kernel))
      << "b took memory a's kernel may still use";
  EXPECT_EQ(engine.stats().num_sync_all_streams, 0);
  EXPECT_EQ(device.ledger().calls(DeviceCall::synchronize_event), 0u);
  EXPECT_GT(engine.stats().num_stream_handovers, 0);
  EXPECT_GT(engine.stats().num_stitches, 0);
  EXPECT_EQ(engine.stats().chunks_held, 28);  // 56 MiB: no chunk beyond them
  // Nothing the other way.
  EXPECT_FALSE(device.streams().ordered_after(a, b, device.streams().submitted(b) + 1));
  engine.free(q);
  engine.check_invariants();
}

// EngineOptions::stream_handovers off: the taker gets the memory only once the freeing stream is
// done, waiting on the host for it when the device has no other (never ordered on the GPU).
TEST(Engine, WithoutHandoversATakerWaitsOnTheHost) {
  SimulatedDevice device(device_of(64 * MiB, /*immediate=*/false));
  Engine engine(device, EngineOptions{.stream_handovers = false});
  constexpr StreamId a = 1, b = 2;
  const std::uint64_t kernel = free_while_its_kernel_runs(device, engine, a);
  void* q = engine.malloc(56 * MiB, b);
  EXPECT_TRUE(device.streams().ordered_after(b, a, kernel));  // done: waited for
  EXPECT_EQ(device.ledger().calls(DeviceCall::wait_event), 0u);
  EXPECT_EQ(engine.stats().num_stream_handovers, 0);
  EXPECT_GT(engine.stats().num_sync_all_streams, 0);
  engine.free(q);
  engine.check_invariants();
}

// While a CUDA graph is captured on the taking stream, no wait can be added to it: the taker
// waits on the host for the freeing stream instead (the engine is told of the capture).
TEST(Engine, ATakerBeingCapturedWaitsOnTheHostInstead) {
  SimulatedDevice device(device_of(64 * MiB, /*immediate=*/false));
  Engine engine(device);
  constexpr StreamId a = 1, b = 2;
  engine.free(engine.malloc(2 * MiB, b));  // b is known to the engine
  const std::uint64_t kernel = free_while_its_kernel_runs(device, engine, a);
  device.streams().set_capturing(b, true);
  engine.set_capturing(true);
  void* q = engine.malloc(56 * MiB, b);
  engine.set_capturing(false);
  device.streams().set_capturing(b, false);
  EXPECT_TRUE(device.streams().ordered_after(b, a, kernel));  // a's kernel is done: waited for
  EXPECT_EQ(device.ledger().calls(DeviceCall::wait_event), 0u);
  EXPECT_GT(engine.stats().num_sync_all_streams, 0);
  engine.free(q);
  engine.check_invariants();
}

// gmem.device_call_us and gmem.stream_wait_us: what mapping and waiting cost the host, which
// is what a user weighs a setting by. On the simulated device they are its modelled figures.
TEST(Engine, StatsSayWhatDeviceCallsAndStreamWaitsCostTheHost) {
  SimDeviceOptions options = device_of(64 * MiB);
  options.lag_us = 5000;  // the GPU 5 ms behind the host
  SimulatedDevice device(options);
  Engine engine(device);
  constexpr StreamId a = 1, b = 2;
  auto step = [&] {
    void* x = engine.malloc(20 * MiB, a);
    void* y = engine.malloc(6 * MiB, a);
    engine.free(x);
    engine.free(y);
  };
  step();
  const MemoryStats first = engine.stats();
  EXPECT_GT(first.device_call_us, 0);
  EXPECT_EQ(first.device_call_us, static_cast<std::int64_t>(device.ledger().modelled_call_us()));
  EXPECT_EQ(first.stream_wait_us, 0);
  for (int i = 0; i < 3; ++i) step();  // the steady state costs nothing
  EXPECT_EQ(engine.stats().device_call_us, first.device_call_us);
  EXPECT_EQ(engine.stats().stream_wait_us, 0);

  // Stream b needs all the memory while stream a's GPU work may still use it: it is handed over
  // (b waits for a on the GPU), which costs calls, not host waiting.
  void* z = engine.malloc(60 * MiB, b);
  const MemoryStats handed = engine.stats();
  EXPECT_GT(handed.num_stream_handovers, 0);
  EXPECT_EQ(handed.stream_wait_us, 0);
  EXPECT_GT(handed.device_call_us, first.device_call_us);
  engine.free(z);
  // Giving the memory back to the device needs b done with it: the host waits.
  engine.empty_cache();
  const MemoryStats after = engine.stats();
  EXPECT_GT(after.stream_wait_us, 0);
  EXPECT_EQ(after.stream_wait_us, static_cast<std::int64_t>(device.ledger().modelled_wait_us()));
  EXPECT_GT(after.device_call_us, handed.device_call_us);
  engine.check_invariants();
}

TEST(Engine, StitchingOnOneStreamNeedsNoWait) {
  // A chunk freed on a stream is mapped at its new place as an alias, without being unmapped
  // where it was: the stream's later kernels come after its earlier ones, so no wait.
  SimulatedDevice device(device_of(8 * MiB, /*immediate=*/false));
  Engine engine(device);
  constexpr StreamId s = 3;
  void* a = engine.malloc(2 * MiB, s);      // page 0
  void* fence = engine.malloc(2 * MiB, s);  // page 1
  device.streams().submit_work(s);
  engine.free(a);
  void* b = engine.malloc(4 * MiB, s);  // fits no free range below: pages 2 and 3
  EXPECT_EQ(device.ledger().calls(DeviceCall::synchronize_event), 0u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::unmap), 0u);
  EXPECT_GT(engine.stats().num_stitches, 0);
  EXPECT_EQ(device.memory().chunk_at(reinterpret_cast<DevicePtr>(b)),
            device.memory().chunk_at(reinterpret_cast<DevicePtr>(a)));
  engine.check_invariants();

  // Now `a`'s page is wanted again while its chunk is busy in `b`: the page is remapped, and
  // unmapping takes effect at once, not in stream order, so the kernels queued before `a` was
  // freed must have finished first (found on the H100: GPT-2 crashed with an illegal address).
  void* again = engine.malloc(2 * MiB, s);
  EXPECT_EQ(again, a);
  EXPECT_GT(device.ledger().calls(DeviceCall::synchronize_event), 0u);
  EXPECT_NE(device.memory().chunk_at(reinterpret_cast<DevicePtr>(again)),
            device.memory().chunk_at(reinterpret_cast<DevicePtr>(b)));
  for (void* p : {again, b, fence}) engine.free(p);
  engine.check_invariants();
}

TEST(Engine, AStealTakesChunksTheGpuIsDoneWithBeforeOnesDueLater) {
  // A chunk freed on the stealing stream a moment ago may be taken at once (stream order), but
  // its page is then unmapped when next used, and the host waits there for the GPU to reach the
  // page's free. Chunks whose pages the GPU is known to be done with go first, even where the
  // prediction of the next use would pick the other.
  SimulatedDevice device(device_of(64 * MiB, /*immediate=*/false));
  Engine engine(device);
  constexpr StreamId s1 = 1, s2 = 2;
  void* b = engine.malloc(2 * MiB, s1);      // taken first: by the next-use prediction, the
  void* fence = engine.malloc(2 * MiB, s1);  // page due last when the steal comes
  void* a = engine.malloc(2 * MiB, s2);
  void* d = engine.malloc(2 * MiB, s2);
  engine.free(a);
  engine.free(d);
  device.streams().complete_stream(s2);  // done (the steal's scan asks)
  device.streams().submit_work(s1);
  engine.free(b);  // the GPU has not reached this free
  ASSERT_EQ(engine.stats().chunks_held, 4);

  void* t = engine.malloc(4 * MiB, s1);  // fits no free range of s1's: two pages, two steals
  EXPECT_EQ(engine.stats().chunks_held, 4);
  const auto chunk_of = [&](void* p) {
    return device.memory().chunk_at(reinterpret_cast<DevicePtr>(p));
  };
  const std::set<ChunkHandle> stolen{chunk_of(t), chunk_of(static_cast<char*>(t) + 2 * MiB)};
  EXPECT_EQ(stolen, (std::set<ChunkHandle>{chunk_of(a), chunk_of(d)}));

  // b's page still has its chunk: taking it again makes no device call and no host wait.
  const std::uint64_t calls =
      device.ledger().calls(DeviceCall::map) + device.ledger().calls(DeviceCall::unmap);
  void* again = engine.malloc(2 * MiB, s1);
  EXPECT_EQ(again, b);
  EXPECT_EQ(device.ledger().calls(DeviceCall::synchronize_event), 0u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::map) + device.ledger().calls(DeviceCall::unmap),
            calls);
  // s2's pages get other chunks when next used, and wait for nothing: s2 is done with them.
  void* a2 = engine.malloc(2 * MiB, s2);
  EXPECT_EQ(a2, a);
  EXPECT_EQ(device.ledger().calls(DeviceCall::synchronize_event), 0u);
  for (void* p : {again, fence, t, a2}) engine.free(p);
  engine.check_invariants();
}

TEST(Engine, StablePagesKeepTheirChunksAndNeverWait) {
  // The sequence above with stable pages (a CUDA graph's private pool): `b` gets chunks of its
  // own, so `a`'s page still has its chunk when it is wanted again. Nothing is unmapped and no
  // stream waited for (a capture forbids the wait; and a replay would run the kernels captured
  // on `a` against whatever the page was remapped to, perhaps a chunk aliased elsewhere).
  SimulatedDevice device(device_of(8 * MiB, /*immediate=*/false));
  Engine engine(device, EngineOptions{.stable_pages = true});
  EXPECT_TRUE(engine.options().stable_pages);
  constexpr StreamId s = 3;
  auto chunk_of = [&](void* p, std::size_t offset = 0) {
    return device.memory().chunk_at(reinterpret_cast<DevicePtr>(p) + offset);
  };
  void* a = engine.malloc(2 * MiB, s);
  void* fence = engine.malloc(2 * MiB, s);
  const ChunkHandle a_chunk = chunk_of(a);
  device.streams().submit_work(s);
  engine.free(a);
  void* b = engine.malloc(4 * MiB, s);
  EXPECT_EQ(engine.stats().num_stitches, 0);
  EXPECT_NE(chunk_of(b), a_chunk);
  EXPECT_NE(chunk_of(b, 2 * MiB), a_chunk);
  void* again = engine.malloc(2 * MiB, s);
  EXPECT_EQ(again, a);
  EXPECT_EQ(chunk_of(again), a_chunk);
  EXPECT_EQ(device.ledger().calls(DeviceCall::unmap), 0u);
  EXPECT_EQ(device.ledger().calls(DeviceCall::record_event) +
                device.ledger().calls(DeviceCall::synchronize_event),
            0u);
  EXPECT_EQ(device.memory().max_chunk_maps(), 1u);
  engine.check_invariants();

  // The device's four chunks are all mapped: another stream's page finds none to take (a
  // default engine would steal a free one) until empty_cache gives the free ones back.
  for (void* p : {again, b}) engine.free(p);
  EXPECT_THROW(engine.malloc(2 * MiB, 5), OutOfMemoryError);
  device.streams().complete_stream(s);
  engine.empty_cache();
  void* other = engine.malloc(2 * MiB, 5);
  EXPECT_EQ(device.memory().max_chunk_maps(), 1u);
  for (void* p : {other, fence}) engine.free(p);
  engine.check_invariants();

  // Steps marked on it are not planned: a plan region's pages would alias online chunks.
  for (int step = 0; step < 8; ++step) {  // two shapes taking turns: planned by default
    engine.mark_step();
    engine.free(engine.malloc((step % 2 ? 4 : 6) * MiB, s));
  }
  EXPECT_EQ(device.memory().max_chunk_maps(), 1u);
  EXPECT_EQ(engine.stats().plans, 0);
}

TEST(Engine, EmptyCacheWaitsForTheFreeingStream) {
  SimulatedDevice device(device_of(64 * MiB, /*immediate=*/false));
  Engine engine(device);
  void* p = engine.malloc(8 * MiB, 3);
  device.streams().submit_work(3);
  engine.free(p);
  EXPECT_EQ(device.ledger().calls(DeviceCall::synchronize_event), 0u);
  engine.empty_cache();
  EXPECT_GT(device.ledger().calls(DeviceCall::synchronize_event), 0u);
  EXPECT_EQ(device.memory().chunk_bytes(), 0u);
  engine.check_invariants();
}

TEST(Engine, RecordStreamHoldsTheBlockUntilThatStreamCaughtUp) {
  SimulatedDevice device(device_of(1 * GiB, /*immediate=*/false));
  Engine engine(device);
  constexpr StreamId compute = 0, side = 5;
  void* p = free_held_by(device, engine, 8 * MiB, compute, side).ptr;
  MemoryStats s = engine.stats();
  EXPECT_EQ(s.allocated_bytes[kAllPools].current, 0);
  EXPECT_EQ(s.active_bytes[kAllPools].current, static_cast<std::int64_t>(8 * MiB));
  void* q = engine.malloc(8 * MiB, compute);
  EXPECT_NE(q, p);  // still in use on the side stream
  engine.check_invariants();
  device.streams().complete_stream(side);
  engine.free(q);
  void* r = engine.malloc(8 * MiB, compute);  // the pending free is processed first
  EXPECT_EQ(engine.stats().active_bytes[kAllPools].current, static_cast<std::int64_t>(8 * MiB));
  engine.free(r);
  engine.check_invariants();
}

// A block a side stream made and the compute stream used (streamed weights, a prefetched batch)
// is its side stream's to reuse from the free on, once the compute stream lets it go: the side
// stream's copies queued after the free do not hold its pages back from another stream.
TEST(Engine, ABlockHeldForAnotherStreamIsDoneOnItsOwnStreamFromItsFree) {
  SimulatedDevice device(device_of(8 * MiB, /*immediate=*/false));
  Engine engine(device);
  constexpr StreamId compute = 0, side = 5;
  void* weights = engine.malloc(8 * MiB, side);
  device.streams().submit_work(side);  // the copy in
  engine.record_stream(weights, compute);
  device.streams().submit_work(compute);  // the layer that reads it
  device.streams().complete_stream(side);
  engine.free(weights);
  MemoryStats s = engine.stats();
  EXPECT_EQ(s.pending_free_bytes, static_cast<std::int64_t>(8 * MiB));
  EXPECT_EQ(s.reserved_bytes[kAllPools].current - s.allocated_bytes[kAllPools].current,
            s.free_mapped_bytes + s.free_unmapped_bytes + s.partial_page_bytes +
                s.small_slack_bytes + s.pending_free_bytes);
  device.streams().submit_work(side);  // the next layer's copy, queued after the free
  device.streams().complete_stream(compute);
  const std::uint64_t waits = device.ledger().calls(DeviceCall::synchronize_event);
  const std::uint64_t handovers = device.ledger().calls(DeviceCall::wait_event);
  void* activations = engine.malloc(8 * MiB, compute);  // the whole device: the weights' chunks
  EXPECT_EQ(device.ledger().calls(DeviceCall::synchronize_event), waits)
      << "waited for the next copy";
  EXPECT_EQ(device.ledger().calls(DeviceCall::wait_event), handovers)
      << "ordered after the next copy";
  EXPECT_EQ(engine.stats().pending_free_bytes, 0);
  engine.free(activations);
  engine.check_invariants();
}

// A block its stream freed while another stream still reads it (record_stream), and the
// device full: the freeing stream's next malloc is made to wait for the other stream on the
// GPU and takes the memory back, where it used to wait on the host (or create a chunk).
void held_free_taken_back(bool handovers) {
  SimulatedDevice device(device_of(8 * MiB, /*immediate=*/false));
  Engine engine(device, EngineOptions{.stream_handovers = handovers});
  constexpr StreamId compute = 0, side = 5;
  const std::uint64_t copy = free_held_by(device, engine, 8 * MiB, compute, side).kernel;
  void* q = engine.malloc(8 * MiB, compute);  // the whole device: the held block's memory
  EXPECT_TRUE(device.streams().ordered_after(compute, side, copy));
  const MemoryStats s = engine.stats();
  EXPECT_EQ(s.pending_free_bytes, 0);
  if (handovers) {
    EXPECT_EQ(device.ledger().calls(DeviceCall::synchronize_event), 0u) << "a host wait";
    EXPECT_EQ(device.ledger().calls(DeviceCall::wait_event), 1u);
    EXPECT_EQ(s.num_stream_handovers, 1);
  } else {
    EXPECT_GT(device.ledger().calls(DeviceCall::synchronize_event), 0u);
    EXPECT_EQ(device.ledger().calls(DeviceCall::wait_event), 0u);
  }
  engine.free(q);
  engine.check_invariants();
}

TEST(Engine, AHeldFreeGoesBackToItsStreamMadeToWaitOnTheGpu) { held_free_taken_back(true); }
TEST(Engine, WithoutHandoversAHeldFreeIsWaitedForOnTheHost) { held_free_taken_back(false); }

// A page whose chunk another stream used (an alias) and freed, with that stream's work since
// done: the engine has not asked, so the page is not known to be ready. Before remapping it
// (an unmap, a map and a set-access: ~60 us on an H100), the engine asks (an event query): a
// side stream that copies the next batch while the main stream's last step is done, but not
// yet polled, remapped pages every step (prefetch_train, docs/notes/2026-11-25-frees-held-for-other-streams-are-stamped-when-freed.md).
TEST(Engine, APageAnotherStreamIsDoneWithIsPolledNotRemapped) {
  SimulatedDevice device(device_of(1 * GiB, /*immediate=*/false));
  Engine engine(device, EngineOptions{.memory_limit = 2 * MiB});  // one chunk
  constexpr StreamId main_stream = 1, side = 2;
  void* x = engine.malloc(2 * MiB, main_stream);
  engine.free(x);
  device.streams().complete_stream(main_stream);
  void* y = engine.malloc(2 * MiB, side);  // the one chunk, stolen: mapped at both pages
  ASSERT_EQ(engine.stats().chunks_held, 1);
  device.streams().submit_work(side);  // a kernel on y
  engine.free(y);
  device.streams().complete_stream(side);  // done, but not polled

  const std::uint64_t maps = device.ledger().calls(DeviceCall::map);
  const std::uint64_t unmaps = device.ledger().calls(DeviceCall::unmap);
  const std::uint64_t events = event_calls(device);
  void* again = engine.malloc(2 * MiB, main_stream);
  EXPECT_EQ(again, x);
  EXPECT_EQ(device.ledger().calls(DeviceCall::map), maps)
      << "remapped a page the side stream was done with";
  EXPECT_EQ(device.ledger().calls(DeviceCall::unmap), unmaps);
  EXPECT_GT(event_calls(device), events);  // it asked
  engine.free(again);
  engine.check_invariants();

  // Work not done yet is not taken for done: the side stream's page is then handed over (the
  // main stream made to wait for the side on the GPU), never used while a kernel may still
  // touch it; no remap either.
  void* z = engine.malloc(2 * MiB, side);
  device.streams().submit_work(side);
  const std::uint64_t kernel = device.streams().submitted(side);
  engine.free(z);
  void* w = engine.malloc(2 * MiB, main_stream);  // its one chunk
  EXPECT_EQ(w, x);
  EXPECT_TRUE(device.streams().ordered_after(main_stream, side, kernel))
      << "the main stream took the chunk the side stream may still use";
  EXPECT_EQ(device.ledger().calls(DeviceCall::map), maps);
  EXPECT_EQ(engine.stats().num_stream_handovers, 1);
  engine.free(w);
  engine.check_invariants();
}

}  // namespace
}  // namespace gmem
