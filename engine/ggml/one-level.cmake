# ggml's CPU backend for one x86-64 level only (engine/ggml/build.sh --cpu-level: ./dev demo's build).
#
# Included right after ggml's own project() (CMAKE_PROJECT_ggml_INCLUDE), so CMakeLists.txt beside this file stays
# the one recipe: these normal variables shadow its cache settings for ggml's directories only. Instead of the
# level list (GGML_CPU_ALL_VARIANTS), ggml builds its plain CPU backend with the level's features on and the others
# off, as its ggml_add_cpu_backend_variant does for each level: the same ARCH_FLAGS and feature macros (its score
# function included). build.sh names the module after the level (libggml-cpu-LEVEL.so).
set(GGML_CPU_ALL_VARIANTS OFF)
foreach(feat NATIVE SSE42 AVX AVX2 BMI2 AVX_VNNI FMA F16C AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16
             AMX_TILE AMX_INT8 AMX_BF16)
  set(GGML_${feat} OFF)
endforeach()
foreach(feat ${TW_GGML_CPU_FEATURES})
  set(GGML_${feat} ON)
endforeach()
