# kdtree_jax_cuda_choice(<out>): whether to build the CUDA handler, ON or OFF in <out>, with a sentence saying why in
# <out>_REASON. Compiling the kernels takes minutes, so by default (AUTO) they are built only where they can run: a
# GPU is visible (a /dev/nvidiaN device exists, or `nvidia-smi -L` lists one). KDTREE_JAX_CUDA=ON builds them anyway
# (a machine that compiles for another), OFF never. The environment wins over a -D option, at every configure
# (nothing sticks in the CMake cache), so that a variable set for one `pip install` is not remembered by the next.
#
# A function of its own so that tests/test_embedded.py can run it under `cmake -P` with a made-up environment.
function(kdtree_jax_cuda_choice out)
  if(DEFINED ENV{KDTREE_JAX_CUDA})
    set(want "$ENV{KDTREE_JAX_CUDA}")
  elseif(DEFINED KDTREE_JAX_CUDA)
    set(want "${KDTREE_JAX_CUDA}")
  else()
    set(want AUTO)
  endif()
  set(given "${want}")
  string(TOUPPER "${want}" want)
  if(want MATCHES "^(ON|1|YES|TRUE|Y)$")
    set(choice ON)
    set(reason "KDTREE_JAX_CUDA=${want}")
  elseif(want MATCHES "^(OFF|0|NO|FALSE|N)$")
    set(choice OFF)
    set(reason "KDTREE_JAX_CUDA=${want}")
  elseif(want STREQUAL "AUTO" OR want STREQUAL "")
    set(choice OFF)
    set(reason "no GPU visible")
    # Any /dev/nvidiaN: a container given one GPU of a larger host may see it under its host number.
    file(GLOB devices "/dev/nvidia[0-9]*")
    if(devices)
      list(GET devices 0 device)
      set(choice ON)
      set(reason "a GPU is visible (${device})")
    else()
      # A missing nvidia-smi leaves rc as an error string, which is not EQUAL 0.
      execute_process(COMMAND nvidia-smi -L RESULT_VARIABLE rc OUTPUT_VARIABLE gpus ERROR_QUIET TIMEOUT 30)
      if(rc EQUAL 0 AND gpus MATCHES "GPU [0-9]")
        set(choice ON)
        set(reason "a GPU is visible (nvidia-smi -L)")
      endif()
    endif()
  else()
    message(FATAL_ERROR "KDTREE_JAX_CUDA must be ON, OFF or AUTO; got '${given}'")
  endif()
  set(${out} ${choice} PARENT_SCOPE)
  set(${out}_REASON "${reason}" PARENT_SCOPE)
endfunction()
