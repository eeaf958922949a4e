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

  @doc """
  A `LlamaCppEx.Server` on `path` for a benchmark (4 slots, 4096-token KV, greedy, no prompt
  cache unless `opts` say otherwise), once its model is loaded: `{server, model}`.
  """
  def start_server(path, opts) do
    defaults = [n_parallel: 4, n_ctx: 4096, temp: 0.0, cache_prompt: false]
    {:ok, s} = LlamaCppEx.Server.start_link([model_path: path] ++ Keyword.merge(defaults, opts))
    {s, wait(s)}
  end

  defp wait(s) do
    case LlamaCppEx.Server.fetch_model(s) do
      {:ok, model} ->
        model

      {:error, :not_ready} ->
        Process.sleep(50)
        wait(s)
    end
  end
end
