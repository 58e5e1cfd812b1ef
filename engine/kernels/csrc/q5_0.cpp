// Q5_0's products (quant.h) and 8-bit products (a8.h).
#include "a8.h"

LAB_GGUF_OPS(q5_0, Q5_0)
LAB_A8_OPS(q5_0, A8Q5_0)
