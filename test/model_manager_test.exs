defmodule LlamaCppEx.ModelManagerTest do
  @moduledoc """
  `LlamaCppEx.ModelManager` end to end on real models (SmolLM2 behind a Server, all-MiniLM
  direct for embeddings, a tiny model), and with a scripted backend for what real loads
  cannot show deterministically (a slow load, a failing one).
  """
  # the manager is a node-wide singleton
  use ExUnit.Case, async: false
  import LlamaCppEx.Eventually, only: [wait_until: 1]

  alias LlamaCppEx.{ModelManager, ModelSupervisor, TestModels}
  alias LlamaCppEx.ModelManager.{Budget, ModelIO}

  doctest Budget

  @tiny Path.expand("fixtures/tiny/tiny-qwen2-f32.gguf", __DIR__)

  defmodule SlowIO do
    @moduledoc false
    @behaviour LlamaCppEx.ModelManager.Backend
    alias LlamaCppEx.ModelManager.ModelIO

    @impl true
    def resolve_source({:path, "slow:" <> path}, opts) do
      receive do
        :go -> :ok
      after
        Keyword.get(opts, :n_ctx, 5_000) -> :ok
      end

      ModelIO.resolve_source({:path, path}, opts)
    end

    def resolve_source({:path, "fail"}, _opts), do: {:error, :disk_on_fire}
    def resolve_source({:path, "crash"}, _opts), do: raise("disk gone")
    def resolve_source(source, opts), do: ModelIO.resolve_source(source, opts)

    @impl true
    def load_model(path, opts), do: ModelIO.load_model(path, opts)
    @impl true
    def start_server(id, path, opts), do: ModelIO.start_server(id, path, opts)
    @impl true
    def stop_server(pid), do: ModelIO.stop_server(pid)
    # a backend that lists its options gets them checked in load/3's caller
    @impl true
    def option_keys, do: ModelIO.option_keys()
  end

  defp start(opts \\ []) do
    start_supervised!({ModelSupervisor, opts})
    :ok
  end

  test "not started: every call says so" do
    assert ModelManager.list() == {:error, :not_started}
    assert ModelManager.default() == {:error, :not_started}
    assert ModelManager.route("x") == {:error, :not_started}
  end

  test "a server-mode chat model and a direct embedding model side by side" do
    start()
    smollm2 = TestModels.smollm2_path()
    minilm = Path.join(TestModels.dir(), "all-minilm-l6-v2")

    assert {:ok, "chat"} =
             ModelManager.load("chat", {:path, smollm2}, n_parallel: 2, n_ctx: 1024, temp: 0.0)

    assert {:ok, "embed"} =
             ModelManager.load("embed", {:path, minilm}, capabilities: [:embed], quantize: :none)

    assert ModelManager.default() == "chat"
    assert {:ok, {:server, pid, _}} = ModelManager.route(:default)
    assert is_pid(pid)
    assert {:ok, {:direct, _model, _}} = ModelManager.route("embed")
    assert ModelManager.loaded?("chat") and ModelManager.loaded?("embed")

    # the same greedy text through the manager as on the model itself
    {:ok, model} = ModelManager.fetch_model("chat")

    {:ok, direct} =
      LlamaCppEx.generate(model, "The capital of France is", max_tokens: 8, temp: 0.0)

    assert {:ok, ^direct} =
             ModelManager.generate(:default, "The capital of France is", max_tokens: 8)

    assert {:ok, reply} =
             ModelManager.chat("chat", [%{role: "user", content: "Say hi"}], max_tokens: 8)

    assert is_binary(reply)

    assert {:ok, %LlamaCppEx.ChatCompletion{}} =
             ModelManager.chat_completion("chat", [%{role: "user", content: "hi"}], max_tokens: 4)

    assert ModelManager.stream("chat", "Once upon a time", max_tokens: 6) |> Enum.join() != ""

    assert {:ok, v} = ModelManager.embed("embed", "a sentence about cats")
    assert length(v) == 384
    assert ModelManager.embed("chat", "x") == {:error, :not_embedding_model}

    ids = ModelManager.list() |> Enum.map(& &1.id) |> Enum.sort()
    assert ids == ["chat", "embed"]
    assert {:ok, %{status: :ready, mode: :server, byte_size: size}} = ModelManager.info("chat")
    assert size == File.stat!(smollm2).size
    refute Map.has_key?(elem(ModelManager.info("chat"), 1), :server_pid)

    assert ModelManager.load("chat", {:path, smollm2}) == {:error, :already_loaded}

    # a crashed server marks its entry :error
    ref = Process.monitor(pid)
    Process.exit(pid, :kill)
    assert_receive {:DOWN, ^ref, _, _, _}
    wait_until(fn -> match?({:ok, %{status: :error}}, ModelManager.info("chat")) end)
    assert ModelManager.generate("chat", "x") == {:error, {:not_ready, :error}}

    assert ModelManager.unload("chat") == :ok
    assert ModelManager.unload("chat") == {:error, :not_loaded}
    assert ModelManager.default() == nil
    assert ModelManager.set_default("embed") == :ok
    assert ModelManager.default() == "embed"
  end

  test "a model from the Hub (a local stand-in), and server-mode embeddings" do
    start()

    {hub, url} =
      LlamaCppEx.Test.HubServer.start(%{
        "org/tiny" => %{files: %{"tiny.gguf" => %{body: File.read!(@tiny)}}}
      })

    cache = Path.join(System.tmp_dir!(), "llama_cpp_ex_mm_#{System.unique_integer([:positive])}")

    on_exit(fn ->
      LlamaCppEx.Test.HubServer.stop(hub)
      File.rm_rf!(cache)
    end)

    hub_opts = [endpoint: url, cache_dir: cache]

    assert {:ok, "hub"} =
             ModelManager.load(
               "hub",
               {:hub, "org/tiny", "tiny.gguf"},
               [
                 mode: :server,
                 capabilities: [:generate, :embed],
                 n_parallel: 1,
                 n_ctx: 256,
                 temp: 0.0
               ] ++
                 hub_opts
             )

    assert File.read!(Path.join([cache, "org/tiny/main/tiny.gguf"])) == File.read!(@tiny)
    assert {:ok, %{status: :ready, mode: :server}} = ModelManager.info("hub")
    {:ok, model} = ModelManager.fetch_model("hub")
    {:ok, want} = LlamaCppEx.generate(model, "hello", max_tokens: 4, temp: 0.0)
    assert ModelManager.generate("hub", "hello", max_tokens: 4) == {:ok, want}

    # the server-mode model embeds through Server.embed/3, as the model route does
    {:ok, direct} = LlamaCppEx.embed(model, "hello world")
    assert {:ok, v} = ModelManager.embed("hub", "hello world")
    dot = Enum.zip_reduce(v, direct, 0.0, fn a, b, acc -> acc + a * b end)
    assert dot > 0.9999

    # a second load of the same file comes from the cache (no download)
    n = length(LlamaCppEx.Test.HubServer.requests(hub))

    assert {:ok, "hub2"} =
             ModelManager.load(
               "hub2",
               {:hub, "org/tiny", "tiny.gguf"},
               [mode: :direct] ++ hub_opts
             )

    assert length(LlamaCppEx.Test.HubServer.requests(hub)) == n
    assert {:error, _} = ModelManager.load("nope", {:hub, "org/tiny", "missing.gguf"}, hub_opts)
  end

  test "a second manager refuses to start" do
    start()
    assert {:error, msg} = GenServer.start(ModelManager, [], name: :another_manager)
    assert msg =~ "node-wide singleton"
  end

  test "the memory budget refuses what does not fit" do
    start(memory_budget: File.stat!(@tiny).size + 10)
    assert {:ok, "a"} = ModelManager.load("a", {:path, @tiny}, mode: :direct)

    assert {:error, {:insufficient_memory, device: :total, required: r, available: a}} =
             ModelManager.load("b", {:path, @tiny}, mode: :direct)

    assert r == File.stat!(@tiny).size and a == 10
    # a refused load leaves no entry
    assert Enum.map(ModelManager.list(), & &1.id) == ["a"]
    # server mode adds the KV estimate
    assert ModelManager.unload("a") == :ok

    assert {:error, {:insufficient_memory, _}} =
             ModelManager.load("s", {:path, @tiny}, n_ctx: 256, n_parallel: 1)
  end

  test "loads run off the manager: it answers while one is in flight; errors pass through" do
    start(io: SlowIO)
    parent = self()

    task =
      Task.async(fn ->
        send(parent, :started)
        ModelManager.load("slow", {:path, "slow:" <> @tiny}, mode: :direct)
      end)

    assert_receive :started
    wait_until(fn -> match?({:ok, %{status: :loading}}, ModelManager.info("slow")) end)
    assert ModelManager.route("slow") == {:error, {:not_ready, :loading}}
    assert ModelManager.load("slow", {:path, @tiny}) == {:error, :already_loaded}
    assert ModelManager.load("f", {:path, "fail"}) == {:error, :disk_on_fire}
    # a backend that raises answers its caller (and leaves no entry)
    assert {:error, {:load_crashed, {%RuntimeError{message: "disk gone"}, _}}} =
             ModelManager.load("c", {:path, "crash"})

    assert ModelManager.info("c") == {:error, :not_loaded}
    assert {:ok, "slow"} = Task.await(task, 10_000)
    assert ModelManager.loaded?("slow")

    assert_raise ArgumentError, ~r/LlamaCppEx.ModelManager.load\/3/, fn ->
      ModelManager.load("x", {:path, @tiny}, bogus: 1)
    end

    assert {:error, {:stat_failed, "/nonexistent.gguf", :enoent}} =
             ModelManager.load("x", {:path, "/nonexistent.gguf"})
  end

  test "auto-loaded models" do
    start(models: [{"tiny", {:path, @tiny}, mode: :direct, default: true}])
    assert ModelManager.loaded?("tiny")
    assert ModelManager.default() == "tiny"
    assert {:ok, _} = ModelManager.generate(:default, "hello", max_tokens: 4)
  end

  test "budget resolution and placement" do
    assert Budget.resolve(:infinity) == %{mode: :unlimited}
    assert %{mode: :combined, limit: l} = Budget.resolve(:auto)
    assert l > 0 and l < Budget.total_ram()

    assert Budget.distribute(100, [mode: :server, n_ctx: 10, n_parallel: 2], 0) == %{
             ram: 100 + 40_960,
             vram: %{}
           }

    assert Budget.distribute(100, [mode: :direct, split_mode: :layer, tensor_split: [1, 3]], 2) ==
             %{
               ram: 0,
               vram: %{0 => 25, 1 => 75}
             }

    assert Budget.check(Budget.resolve(%{ram: 50}), %{ram: 60, vram: %{}}, Budget.empty_usage()) ==
             {:error, {:insufficient_memory, device: :ram, required: 60, available: 50}}

    assert_raise ArgumentError, ~r/memory_budget/, fn -> Budget.resolve(:lots) end
    assert ModelIO.option_keys() |> Enum.member?(:n_parallel)
  end
end
