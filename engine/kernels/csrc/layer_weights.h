// lab.layers' weights of one decoder layer, in the order the caller passes them (capabilities() reports the names):
// the two norms' weights, then (weight, aux, bias) of each product in LAB_LAYER_PRODUCTS' order, which is also the
// order of a layer's product kinds.
#pragma once
#include <cstdint>

#define LAB_LAYER_PRODUCTS(X) X(QKV, "qkv") X(O, "o") X(GATE_UP, "gate_up") X(DOWN, "down")

#define LAB_KIND(P, name) P##_KIND,
enum LayerKind : int64_t { LAB_LAYER_PRODUCTS(LAB_KIND) LAYER_KINDS };  // index into a layer's kinds; their count
#undef LAB_KIND

#define LAB_WEIGHTS(P, name) P##_WEIGHT, P##_AUX, P##_BIAS,
enum LayerWeight : int64_t { INPUT_NORM, POST_NORM, LAB_LAYER_PRODUCTS(LAB_WEIGHTS) LAYER_WEIGHTS };  // and weights
#undef LAB_WEIGHTS

#define LAB_NAMES(P, name) name ".weight", name ".aux", name ".bias",
constexpr const char* LAYER_WEIGHT_NAMES[] = {"input_norm", "post_norm", LAB_LAYER_PRODUCTS(LAB_NAMES)};
#undef LAB_NAMES
static_assert(sizeof(LAYER_WEIGHT_NAMES) / sizeof(*LAYER_WEIGHT_NAMES) == LAYER_WEIGHTS, "a name for each weight");

struct LayerProduct {  // one product of a layer: its kind's index, and its weight, aux and bias's
  LayerKind kind;
  LayerWeight w, aux, bias;
};
#define LAB_PRODUCT(P, name) constexpr LayerProduct P##_PRODUCT{P##_KIND, P##_WEIGHT, P##_AUX, P##_BIAS};
LAB_LAYER_PRODUCTS(LAB_PRODUCT)
#undef LAB_PRODUCT
