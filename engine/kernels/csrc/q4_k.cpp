// Q4_K's products (quant.h).
#include "quant.h"

LAB_GGUF_OPS(q4_k, Q4_K)
