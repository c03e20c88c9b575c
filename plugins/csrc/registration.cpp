// The one place the mtp plugin ops' schemas are defined. The kernels register themselves per op
// (TORCH_LIBRARY_IMPL(mtp, CPU, ...) in kv_write.cpp, paged_attention.cpp, ...). Python adds the fake
// (meta) implementations for torch.export / torch.compile and the CUDA implementations (Triton), and
// implements moe_experts_exchange (the MPI token exchange of expert / tensor parallelism).
//
// The KV pool travels by address (int64[1]) plus geometry ints (plugins/kv_pool.py): no tensor the graph
// sees is mutated, so the schemas are functional; kv_write returns the rows stored, which the attention
// takes as `after` so every graph orders the read after the write.
#include <torch/library.h>

#include "amx_bf16.h"
#include "common.h"

namespace mtp {

// "" reads the ISA the kernels use; "generic" / "avx2" / "avx512" / "best" sets it (tests run each path).
static std::string cpu_isa(c10::string_view set) {
  if (set == "generic") set_isa(Isa::generic);
  else if (set == "avx2") set_isa(Isa::avx2);
  else if (set == "avx512") set_isa(Isa::avx512);
  else if (set == "best") set_isa(best_isa());
  else TORCH_CHECK_VALUE(set.empty(), "mtp::cpu_isa: unknown isa '", set, "' (generic, avx2, avx512, best or '')");
  return isa_name(active_isa());
}

int64_t gdn_chunk_min_run(int64_t set);  // gdn_step.cpp

// AMX's row threshold (amx_bf16.h): -1 reads it, n >= 1 sets it; 0 if this CPU / OS cannot run AMX
static int64_t amx_rows_from(int64_t set) { return amx_usable() ? amx_min_rows(set) : 0; }

}  // namespace mtp

TORCH_LIBRARY_FRAGMENT(mtp, m) {
  m.def("kv_write(Tensor k, Tensor v, Tensor counts, Tensor starts, Tensor block_tables, Tensor pool_ptr, "
        "SymInt plane, SymInt num_planes, SymInt num_blocks, SymInt block_size, SymInt num_kv_heads, "
        "SymInt head_dim, SymInt dtype, SymInt rope_dim, float rope_theta) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor q_counts, Tensor kv_lens, Tensor block_tables, Tensor pool_ptr, "
        "Tensor after, SymInt plane, SymInt num_planes, SymInt num_blocks, SymInt block_size, SymInt num_kv_heads, "
        "SymInt head_dim, SymInt dtype, float scale) -> Tensor");
  m.def("swa_paged_attention(Tensor q, Tensor q_counts, Tensor kv_lens, Tensor block_tables, Tensor pool_ptr, "
        "Tensor after, Tensor sinks, SymInt plane, SymInt num_planes, SymInt num_blocks, SymInt block_size, "
        "SymInt num_kv_heads, SymInt head_dim, SymInt dtype, float scale, SymInt window) -> Tensor");
  m.def("mla_kv_write(Tensor latent, Tensor counts, Tensor starts, Tensor block_tables, Tensor pool_ptr, "
        "Tensor inv_freq, SymInt plane, SymInt num_planes, SymInt num_blocks, SymInt block_size, SymInt latent_dim, "
        "SymInt dtype, SymInt rope_dim, float rope_scale) -> Tensor");
  m.def("mla_paged_attention(Tensor q, Tensor q_counts, Tensor kv_lens, Tensor block_tables, Tensor pool_ptr, "
        "Tensor after, SymInt plane, SymInt num_planes, SymInt num_blocks, SymInt block_size, SymInt latent_dim, "
        "SymInt dtype, SymInt rope_dim, float scale) -> Tensor");
  // DeepSeek Sparse Attention: each query row's top-k cached positions by its indexer's score over the indexer-key
  // plane (a key in the first q.size(2) values of a row_dim-wide kv_kind 1 row); int64 [T, topk], -1 = unused
  // (dsa_index_topk.cpp, plugins/dsa_reference.py)
  m.def("dsa_index_topk(Tensor q, Tensor weights, Tensor q_counts, Tensor kv_lens, Tensor block_tables, "
        "Tensor pool_ptr, SymInt plane, SymInt num_planes, SymInt num_blocks, SymInt block_size, SymInt row_dim, "
        "SymInt dtype, SymInt topk, float scale) -> Tensor");
  // Absorbed MLA attention of each row over its selected positions (int64 [T, topk], -1 = unused) of a latent plane
  // (dsa_sparse_attention.cpp, plugins/dsa_reference.py); [T, H, latent_dim - rope_dim]
  m.def("dsa_sparse_attention(Tensor q, Tensor q_counts, Tensor selected, Tensor block_tables, Tensor pool_ptr, "
        "SymInt plane, SymInt num_planes, SymInt num_blocks, SymInt block_size, SymInt latent_dim, SymInt dtype, "
        "SymInt rope_dim, float scale) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_down, "
        "SymInt num_experts, SymInt ep_size, SymInt tp_size=1, SymInt tp_rank=0) -> Tensor");
  // The experts held here (global ids expert_offset .. expert_offset + E_local - 1), no exchange: the
  // single-rank moe_experts and the per-rank compute of the exchange both run this kernel.
  m.def("moe_experts_local(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_down, "
        "int expert_offset) -> Tensor");
  // moe_experts_local over FP8 expert weights as released: e4m3 [E, 2I, H] / [E, H, I] (or uint8 bits) with fp32
  // block scales [E, 2*ceil(I/128), ceil(H/128)] (gate's block rows, then up's) / [E, ceil(H/128), ceil(I/128)];
  // fp32 x, fp32 out (moe_experts.cpp)
  m.def("moe_experts_fp8(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_gate_up_scale, "
        "Tensor w_down, Tensor w_down_scale, int expert_offset) -> Tensor");
  // moe_experts_local over `mtp-build --quantize int8`'s experts: int8 [E, 2I, H] / [E, H, I] with one fp32 scale per
  // output row, [E, 2I] / [E, H] (plugins/reference.py quantize_int8 per expert); fp32 x, fp32 out (moe_experts.cpp)
  m.def("moe_experts_int8(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_gate_up_scale, "
        "Tensor w_down, Tensor w_down_scale, int expert_offset) -> Tensor");
  // moe_experts_local over `mtp-build --quantize int4`'s experts: packed int4 [E, 2I, H/2] / [E, H, I/2] (uint8, as
  // linear_int4's) with one fp32 scale per group_size input features of a row, [E, 2I, H/G] / [E, H, I/G]
  // (plugins/reference.py quantize_int4 per expert stack); fp32 x, fp32 out (moe_experts.cpp)
  m.def("moe_experts_int4(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_gate_up_scale, "
        "Tensor w_down, Tensor w_down_scale, int group_size, int expert_offset) -> Tensor");
  // ep_size > 1 or tp_size > 1: implemented in Python (plugins/moe_ep.py, mpi4py); moe_experts' CPU kernel
  // calls it through the dispatcher.
  m.def("moe_experts_exchange(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_down, "
        "int num_experts, int ep_size, int tp_size, int tp_rank) -> Tensor");
  // One Gated DeltaNet layer's token mixing; the conv / ssm state pools by address, written in place (gdn_step.cpp)
  m.def("gdn_step(Tensor mixed, Tensor b, Tensor a, Tensor q_counts, Tensor starts, Tensor read_slots, "
        "Tensor write_slots, Tensor conv_pool_ptr, Tensor ssm_pool_ptr, Tensor conv_weight, Tensor a_log, "
        "Tensor dt_bias, int layer, int num_layers, int num_slots, int conv_dim, int conv_kernel, int num_k_heads, "
        "int num_v_heads, int head_k_dim, int head_v_dim, int dtype) -> Tensor");
  // x [..., K] fp32 @ weight[N, K] bf16 (stored [N, K], read as bf16, fp32 math) + bias fp32 [N] -> fp32 [..., N]
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // x [..., K] fp32 @ dequant(weight)^T + bias: weight [N, K] float8_e4m3fn (or its uint8 bits), scale_inv fp32
  // [ceil(N/128), ceil(K/128)] (the FP8 releases' 128 x 128 block scales), read as bytes, fp32 math -> fp32 [..., N]
  m.def("linear_fp8(Tensor x, Tensor weight, Tensor scale_inv, Tensor? bias) -> Tensor");
  // x [..., K] fp32 @ dequant(weight)^T + bias: weight [N, K] int8, scale fp32 [N] (symmetric per output channel,
  // dequant = q * scale[n]; plugins/reference.py quantize_int8), read as bytes, fp32 math -> fp32 [..., N]
  m.def("linear_int8(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
  // x [..., K] fp32 @ dequant(weight)^T + bias: weight [N, K/2] uint8, two two's-complement int4 per byte (column 2i
  // in the low nibble), scale fp32 [N, K/group_size] (symmetric per group of input features, dequant = q * scale[n,
  // k / group_size]; plugins/reference.py quantize_int4), unpacked in registers, fp32 math -> fp32 [..., N]
  m.def("linear_int4(Tensor x, Tensor weight, Tensor scale, int group_size, Tensor? bias) -> Tensor");
  m.def("cpu_isa(str set='') -> str", &mtp::cpu_isa);
  // gdn_step's shortest run of prompt rows that takes the chunked form: -1 reads it, n >= 1 sets it (tests, bench)
  m.def("gdn_chunk_min_run(int set=-1) -> int", &mtp::gdn_chunk_min_run);
  // the exact AMX multiply's row threshold (linear_bf16): -1 reads it, n >= 1 sets it; 0 where AMX is not usable
  m.def("amx_min_rows(int set=-1) -> int", &mtp::amx_rows_from);
}
