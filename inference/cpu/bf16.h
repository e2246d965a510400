// What the AVX512-BF16 library's sources (small_gemm.cpp, prefix_attention.cpp, gguf_linear_bf16.cpp) share about
// bf16 values.
#pragma once

#include <immintrin.h>

#include <cstdint>

// 16 bf16 values -> 16 floats (a bf16 is a float's high half)
inline __m512 bf16x16_to_float(const uint16_t* p) {
  const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
}
