defmodule LlamaCppEx.TestModels do
  @moduledoc false
  # Locates the models fetched by scripts/fetch_models.py (tests fail, not skip, when missing).

  @smollm2 "SmolLM2-135M-Instruct.Q4_1.gguf"
  @gemma3 "gemma-3-270m-q4_k_m.gguf"

  def dir do
    System.get_env("LLAMA_CPP_EX_MODELS") || System.get_env("LLAMA_CACHE_DIR") ||
      Path.join(System.user_home!(), ".cache/llama_cpp_ex/models")
  end

  def path(file) do
    p = Path.join(dir(), file)

    unless File.regular?(p) do
      raise "#{p} is missing: run `python3 scripts/fetch_models.py` (or `make models`) first"
    end

    p
  end

  def smollm2_path, do: path(@smollm2)
  def gemma3_path, do: path(@gemma3)

  @doc "SmolLM2 loaded once per test run and shared through :persistent_term."
  def smollm2 do
    case :persistent_term.get({__MODULE__, :smollm2}, nil) do
      nil ->
        {:ok, model} = LlamaCppEx.load_model(smollm2_path())
        :persistent_term.put({__MODULE__, :smollm2}, model)
        model

      model ->
        model
    end
  end

  @doc "Waits for a server's model to load."
  def wait_model(server) do
    case LlamaCppEx.Server.fetch_model(server) do
      {:ok, model} -> {:ok, model}
      {:error, :not_ready} -> wait_model(server)
      other -> other
    end
  end

  @doc """
  Starts a `LlamaCppEx.Server` on SmolLM2 with `opts`, unlinked (a failing test cannot take
  it down), stopped when the test (or the module, from `setup_all`) ends; returns
  `{server, model}` once the model is loaded.
  """
  def start_server(opts) do
    {:ok, server} = LlamaCppEx.Server.start_link([model_path: smollm2_path()] ++ opts)
    Process.unlink(server)
    {:ok, model} = wait_model(server)
    ExUnit.Callbacks.on_exit(fn -> if Process.alive?(server), do: GenServer.stop(server) end)
    {server, model}
  end

  @doc """
  Forwards the telemetry `events` to the calling test process as
  `{:telemetry, event, measurements, metadata}`, detached when the test ends.
  """
  def attach_telemetry(events) do
    parent = self()
    id = make_ref()

    :telemetry.attach_many(
      id,
      events,
      fn e, m, meta, _ -> send(parent, {:telemetry, e, m, meta}) end,
      nil
    )

    ExUnit.Callbacks.on_exit(fn -> :telemetry.detach(id) end)
  end
end
