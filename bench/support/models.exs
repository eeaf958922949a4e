defmodule Bench.Models do
  @moduledoc false
  # Where the benchmarks find their model: LLAMA_MODEL_PATH, else SmolLM2 in the cache
  # (LLAMA_CACHE_DIR or ~/.cache/llama_cpp_ex/models, as scripts/fetch_models.py puts it).

  def default_path do
    System.get_env("LLAMA_MODEL_PATH") ||
      Path.join(
        System.get_env("LLAMA_CACHE_DIR") ||
          Path.join(System.user_home!(), ".cache/llama_cpp_ex/models"),
        "SmolLM2-135M-Instruct.Q4_1.gguf"
      )
  end
end
