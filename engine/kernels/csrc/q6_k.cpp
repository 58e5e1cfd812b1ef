// Q6_K's products (quant.h) and 8-bit products (a8.h).
#include "a8.h"

LAB_GGUF_OPS(q6_k, Q6_K)
LAB_A8_OPS(q6_k, A8Q6_K)
