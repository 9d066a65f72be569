// A check of the CUDA driver alone (no gmem): which virtual-memory and event calls a stream
// capture tolerates, made by the capturing thread or by another thread, with the capture in
// global or relaxed mode. Each case captures one kernel on a fresh stream, makes the call while
// the capture is open, then ends the capture, instantiates and replays the graph; a case passes
// when the call and all of that succeed. Build and run on a GPU machine:
//   nvcc -arch=sm_90 -o unmap_in_capture gpu/unmap_in_capture.cu -lcuda && ./unmap_in_capture
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <functional>
#include <thread>

static CUmemAllocationProp prop;
static CUmemAccessDesc access;
static size_t g;
static CUdeviceptr base;

__global__ void touch(int* p) { p[threadIdx.x] += 1; }

static const char* name(CUresult r) {
  const char* n = nullptr;
  cuGetErrorName(r, &n);
  return n;
}

// A chunk mapped at base + slot * g with access set, idle (no kernel uses it).
static CUmemGenericAllocationHandle mapped(int slot) {
  CUmemGenericAllocationHandle h;
  cuMemCreate(&h, g, &prop, 0);
  cuMemMap(base + slot * g, g, 0, h, 0);
  cuMemSetAccess(base + slot * g, g, &access, 1);
  return h;
}

static void run_case(const char* what, cudaStreamCaptureMode mode, bool other_thread,
                     const std::function<CUresult()>& call) {
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  int* buffer;
  cudaMalloc(&buffer, 1024);
  cudaStreamSynchronize(s);
  CUresult during = CUDA_SUCCESS;
  cudaError_t begin = cudaStreamBeginCapture(s, mode);
  touch<<<1, 32, 0, s>>>(buffer);
  if (other_thread) {
    std::thread t([&] { during = call(); });
    t.join();
  } else {
    during = call();
  }
  touch<<<1, 32, 0, s>>>(buffer);
  cudaGraph_t graph = nullptr;
  cudaError_t end = cudaStreamEndCapture(s, &graph);
  cudaError_t launched = cudaErrorUnknown;
  if (end == cudaSuccess) {
    cudaGraphExec_t exec;
    if (cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
      launched = cudaGraphLaunch(exec, s);
      if (launched == cudaSuccess) launched = cudaStreamSynchronize(s);
      cudaGraphExecDestroy(exec);
    }
    cudaGraphDestroy(graph);
  }
  cudaGetLastError();
  std::printf("%-52s %-7s %-13s call %-34s end %-38s replay %s\n", what,
              mode == cudaStreamCaptureModeGlobal ? "global" : "relaxed",
              other_thread ? "other thread" : "same thread", name(during),
              cudaGetErrorName(end), cudaGetErrorName(launched));
  (void)begin;
  cudaFree(buffer);
  cudaStreamDestroy(s);
}

int main() {
  cudaFree(nullptr);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  cuMemAddressReserve(&base, 256 * g, 0, 0, 0);
  int slot = 0;
  for (cudaStreamCaptureMode mode : {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeRelaxed}) {
    for (bool other : {false, true}) {
      run_case("cuMemCreate + cuMemMap + cuMemSetAccess", mode, other, [&] {
        CUmemGenericAllocationHandle h;
        CUresult r = cuMemCreate(&h, g, &prop, 0);
        if (r == CUDA_SUCCESS) r = cuMemMap(base + slot * g, g, 0, h, 0);
        if (r == CUDA_SUCCESS) r = cuMemSetAccess(base + slot * g, g, &access, 1);
        ++slot;
        return r;
      });
      const int idle = slot++;
      CUmemGenericAllocationHandle h = mapped(idle);
      run_case("cuMemUnmap of an idle mapping", mode, other,
               [&] { return cuMemUnmap(base + idle * g, g); });
      run_case("cuMemMap of that chunk elsewhere + cuMemSetAccess", mode, other, [&] {
        CUresult r = cuMemMap(base + slot * g, g, 0, h, 0);
        if (r == CUDA_SUCCESS) r = cuMemSetAccess(base + slot * g, g, &access, 1);
        ++slot;
        return r;
      });
      const int gone = slot++;
      CUmemGenericAllocationHandle r2 = mapped(gone);
      cuMemUnmap(base + gone * g, g);
      run_case("cuMemRelease of an unmapped chunk", mode, other, [&] { return cuMemRelease(r2); });
      cudaEvent_t e;
      cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
      cudaStream_t other_stream;
      cudaStreamCreateWithFlags(&other_stream, cudaStreamNonBlocking);
      cudaEventRecord(e, other_stream);
      run_case("cudaEventQuery of another stream's event", mode, other,
               [&] { return static_cast<CUresult>(cudaEventQuery(e)); });
      run_case("cudaEventRecord on another stream + query", mode, other, [&] {
        cudaError_t r = cudaEventRecord(e, other_stream);
        if (r == cudaSuccess) r = cudaEventQuery(e);
        return static_cast<CUresult>(r);
      });
      run_case("cudaEventSynchronize of another stream's event", mode, other,
               [&] { return static_cast<CUresult>(cudaEventSynchronize(e)); });
      run_case("cudaEventSynchronize, the thread's mode relaxed", mode, other, [&] {
        cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
        cudaThreadExchangeStreamCaptureMode(&relaxed);
        const cudaError_t r = cudaEventSynchronize(e);
        cudaThreadExchangeStreamCaptureMode(&relaxed);
        return static_cast<CUresult>(r);
      });
      run_case("cudaEventRecord on another stream + query, relaxed", mode, other, [&] {
        cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
        cudaThreadExchangeStreamCaptureMode(&relaxed);
        cudaError_t r = cudaEventRecord(e, other_stream);
        if (r == cudaSuccess) r = cudaEventQuery(e);
        cudaThreadExchangeStreamCaptureMode(&relaxed);
        return static_cast<CUresult>(r);
      });
      run_case("cudaStreamIsCapturing of another stream", mode, other, [&] {
        cudaStreamCaptureStatus status;
        return static_cast<CUresult>(cudaStreamIsCapturing(other_stream, &status));
      });
      cudaStreamDestroy(other_stream);
      cudaEventDestroy(e);
    }
  }
  {  // the legacy default stream while a blocking stream is captured
    cudaStream_t blocking;
    cudaStreamCreate(&blocking);
    cudaStreamBeginCapture(blocking, cudaStreamCaptureModeRelaxed);
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    const CUresult r = cuStreamIsCapturing(nullptr, &status);
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(blocking, &graph);
    std::printf("cuStreamIsCapturing(legacy stream) while a blocking stream is captured: %s, "
                "status %d; end %s\n", name(r), static_cast<int>(status), cudaGetErrorName(end));
    if (graph) cudaGraphDestroy(graph);
    cudaStreamDestroy(blocking);
  }
  return 0;
}
