defmodule LlamaCppEx.DropInTest do
  @moduledoc """
  What an application written for `llama_cpp_ex` relies on, each test written from the
  contract (`llama_cpp_ex_api.md`): the answers its APIs give, the options they accept, the
  defaults, and user-written batch strategies, on real models.
  """
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog

  alias LlamaCppEx.{Context, Hub, Model, ModelManager, ModelSupervisor, Sampler, Server}
  alias LlamaCppEx.ModelManager.{Budget, ModelIO}
  alias LlamaCppEx.TestModels

  @moduletag timeout: 600_000

  setup_all do
    {server, model} = TestModels.start_server(n_parallel: 2, n_ctx: 2048, temp: 0.0)
    %{server: server, model: model, path: TestModels.smollm2_path()}
  end

  describe "answers" do
    test "subscribe_stream_tokens/4 raises on an unknown option", %{server: server, model: model} do
      {:ok, ids} = LlamaCppEx.Tokenizer.encode(model, "Hello")

      assert_raise ArgumentError, ~r/unknown option: :max_tokenz/, fn ->
        Server.subscribe_stream_tokens(server, ids, make_ref(), max_tokenz: 3)
      end
    end

    test "ModelIO.start_server/3 raises on an unknown option and keeps the server's reason",
         %{path: path} do
      assert_raise ArgumentError, ~r/LlamaCppEx.ModelManager.load\/3.*n_paralell/s, fn ->
        ModelIO.start_server("typo", path, n_paralell: 2)
      end

      start_supervised!(ModelSupervisor)

      assert ModelIO.start_server("missing", "/nonexistent/model.gguf", []) ==
               {:error, {:model_not_found, "/nonexistent/model.gguf"}}
    end

    test ":devices names must be devices", %{path: path} do
      assert Model.load(path, devices: ["GPU42"]) ==
               {:error, "unknown device: GPU42 (available: CPU)"}

      assert {:ok, _} = Model.load(path, devices: ["CPU"])
    end

    test "only -1 means the last row when sampling at an index", %{model: model} do
      {:ok, ctx} = Context.create(model, n_ctx: 64)
      {:ok, sampler} = Sampler.create(model, temp: 0.0)
      {:ok, ids} = LlamaCppEx.Tokenizer.encode(model, "The capital of France is")
      :ok = Context.decode(ctx, ids)
      assert is_integer(Sampler.sample_at(sampler, ctx, -1))

      for idx <- [-2, -7, -9999] do
        assert_raise ArgumentError, ~r/invalid_index/, fn ->
          Sampler.sample_at(sampler, ctx, idx)
        end
      end
    end

    test "request.start telemetry names the call", %{server: server, model: model} do
      TestModels.attach_telemetry([[:llama_cpp_ex, :server, :request, :start]])
      {:ok, _} = Server.generate(server, "One", max_tokens: 2)
      assert_receive {:telemetry, _, _, %{mode: :generate}}, 10_000
      _ = server |> Server.stream("Two", max_tokens: 2) |> Enum.to_list()
      assert_receive {:telemetry, _, _, %{mode: :stream}}, 10_000
      msgs = [%{role: "user", content: "Hi"}]
      {:ok, _} = LlamaCppEx.chat_completion(server, msgs, max_tokens: 2)
      assert_receive {:telemetry, _, _, %{mode: :generate}}, 10_000
      _ = server |> LlamaCppEx.stream_chat_completion(msgs, max_tokens: 2) |> Enum.to_list()
      assert_receive {:telemetry, _, _, %{mode: :stream}}, 10_000
      {:ok, ids} = LlamaCppEx.Tokenizer.encode(model, "Four")
      {:ok, _} = Server.complete_tokens(server, ids, max_tokens: 2)
      assert_receive {:telemetry, _, _, %{mode: :generate}}, 10_000
    end

    test "fetch_model/1 asks a process that stands in for a server with :get_model", %{
      model: model
    } do
      for reply <- [model, {:ok, model}] do
        pid =
          spawn_link(fn ->
            receive do
              {:"$gen_call", from, :get_model} -> GenServer.reply(from, reply)
            end
          end)

        assert Server.fetch_model(pid) == {:ok, model}
      end
    end

    test "a Server on an empty directory fails at start like a missing file" do
      dir =
        Path.join(System.tmp_dir!(), "llama_cpp_ex_empty_#{System.unique_integer([:positive])}")

      File.mkdir_p!(dir)
      on_exit(fn -> File.rm_rf!(dir) end)
      Process.flag(:trap_exit, true)
      assert Server.start_link(model_path: dir) == {:error, {:model_not_found, dir}}
    end
  end

  describe "options" do
    test "generate/3 and stream/3 accept the chat keys; a raw prompt ignores them",
         %{server: server, model: model} do
      chat = [enable_thinking: true, add_assistant: false, chat_template_kwargs: %{"x" => 1}]
      base = [max_tokens: 6, temp: 0.0]
      {:ok, want} = LlamaCppEx.generate(model, "Colors: red,", base)
      assert LlamaCppEx.generate(model, "Colors: red,", base ++ chat) == {:ok, want}
      assert model |> LlamaCppEx.stream("Colors: red,", base ++ chat) |> Enum.join() == want
      assert Server.generate(server, "Colors: red,", [max_tokens: 6] ++ chat) == {:ok, want}
    end

    test "embed_batch/3 takes :max_batch_sequences" do
      {:ok, minilm} = LlamaCppEx.load_model(Path.join(TestModels.dir(), "all-minilm-l6-v2"))
      texts = for i <- 1..7, do: "sentence number #{i}"
      {:ok, all} = LlamaCppEx.embed_batch(minilm, texts)

      for n <- [1, 3, 64] do
        {:ok, grouped} = LlamaCppEx.embed_batch(minilm, texts, max_batch_sequences: n)

        for {a, b} <- Enum.zip(all, grouped),
            do:
              assert(
                Enum.zip(a, b) |> Enum.map(fn {x, y} -> abs(x - y) end) |> Enum.max() < 1.0e-3
              )
      end

      assert {:error, "invalid max_batch_sequences: 0"} =
               LlamaCppEx.embed_batch(minilm, texts, max_batch_sequences: 0)
    end

    defmodule RecordingIO do
      @moduledoc false
      # a custom backend without option_keys/0: it receives every option as given
      @behaviour LlamaCppEx.ModelManager.Backend
      @impl true
      def resolve_source({:path, p}, opts) do
        send(:drop_in_test, {:resolve, opts})
        {:ok, p, 1}
      end

      @impl true
      def load_model(path, opts) do
        send(:drop_in_test, {:load, opts})
        LlamaCppEx.ModelManager.ModelIO.load_model(path, [])
      end

      @impl true
      def start_server(_id, _path, _opts), do: {:error, :unsupported}
      @impl true
      def stop_server(_pid), do: :ok
    end

    test "ModelManager.load/3 forwards options it does not know to a custom backend",
         %{path: path} do
      Process.register(self(), :drop_in_test)
      start_supervised!({ModelSupervisor, io: RecordingIO})

      assert {:ok, "m"} =
               ModelManager.load("m", {:path, path}, mode: :direct, gpu_pool: :a100, shards: 2)

      assert_received {:load, opts}
      assert opts[:gpu_pool] == :a100 and opts[:shards] == 2
    end

    test "ModelManager.load/3 with the default backend raises on an unknown option in the caller",
         %{path: path} do
      start_supervised!(ModelSupervisor)

      assert_raise ArgumentError, ~r/n_paralell/, fn ->
        ModelManager.load("m", {:path, path}, n_paralell: 2)
      end

      assert ModelManager.list() == []
    end
  end

  describe "defaults" do
    test "auto-loaded models are ready when the supervisor's start_link returns", %{path: path} do
      start_supervised!(
        {ModelSupervisor,
         models: [{"chat", {:path, path}, n_ctx: 512, n_parallel: 1, default: true}]}
      )

      assert ModelManager.loaded?("chat")
      assert {:ok, _} = ModelManager.generate(:default, "Hi", max_tokens: 2)
    end

    test "a failed auto-load is logged and leaves the others" do
      log =
        capture_log(fn ->
          start_supervised!(
            {ModelSupervisor,
             memory_budget: 10, models: [{"big", {:path, TestModels.smollm2_path()}}]}
          )
        end)

      assert log =~ ~s(auto-load of "big" failed)
      assert log =~ "insufficient_memory"
      assert ModelManager.list() == []
    end

    test "main_gpu takes the whole footprint unless split by layer or row" do
      assert Budget.distribute(1000, [mode: :direct, main_gpu: 1], 2) ==
               %{ram: 0, vram: %{1 => 1000}}

      assert Budget.distribute(1000, [mode: :direct], 2) == %{ram: 0, vram: %{0 => 1000}}

      assert Budget.distribute(1000, [mode: :direct, split_mode: :layer], 2) ==
               %{ram: 0, vram: %{0 => 500, 1 => 500}}

      assert Budget.distribute(
               1000,
               [mode: :direct, split_mode: :row, tensor_split: [1, 0, 3]],
               3
             ) ==
               %{ram: 0, vram: %{0 => 250, 2 => 750}}

      kv = 2 * 1024 * 16 * 2

      assert Budget.distribute(1000, [n_ctx: 16, n_parallel: 2, main_gpu: 1], 2) ==
               %{ram: 0, vram: %{1 => 1000 + kv}}

      assert Budget.distribute(1000, [n_ctx: 16, n_parallel: 2, offload_kqv: false], 1) ==
               %{ram: kv, vram: %{0 => 1000}}

      assert Budget.distribute(1000, [mode: :direct, n_gpu_layers: 0], 2) == %{
               ram: 1000,
               vram: %{}
             }
    end

    test "a BERT checkpoint directory loads unquantized" do
      dir = Path.join(TestModels.dir(), "all-minilm-l6-v2")
      {:ok, default} = LlamaCppEx.load_model(dir)
      {:ok, stored} = LlamaCppEx.load_model(dir, quantize: :none)
      {:ok, q8} = LlamaCppEx.load_model(dir, quantize: :q8_0)
      assert Model.size(default) == Model.size(stored)
      assert Model.size(q8) < Model.size(stored)
    end
  end

  describe "user-written batch strategies" do
    alias LlamaCppEx.Test.ContractStrategies, as: C

    test "strategies written to the contract give the built-ins' text", %{model: model} do
      prompts = ["Colors: red, green,", "One, two, three,", "The capital of France is"]

      want =
        for p <- prompts do
          {:ok, t} = LlamaCppEx.generate(model, p, max_tokens: 8, temp: 0.0)
          {:ok, t}
        end

      for strategy <- [C.GreedyDecodeFirst, C.PrefillFirst, C.RoundRobin] do
        {server, _} =
          TestModels.start_server(
            n_parallel: 2,
            n_ctx: 1024,
            temp: 0.0,
            chunk_size: 3,
            batch_strategy: strategy
          )

        got =
          prompts
          |> Enum.map(&Task.async(fn -> Server.generate(server, &1, max_tokens: 8) end))
          |> Enum.map(&Task.await(&1, 60_000))

        assert got == want, inspect(strategy)
        GenServer.stop(server)
      end
    end

    test "a strategy that raises costs no request: the default plans those ticks", %{
      model: model
    } do
      TestModels.attach_telemetry([[:llama_cpp_ex, :server, :strategy, :exception]])
      {:ok, want} = LlamaCppEx.generate(model, "Colors: red,", max_tokens: 6, temp: 0.0)

      log =
        capture_log(fn ->
          {server, _} = TestModels.start_server(n_ctx: 512, temp: 0.0, batch_strategy: C.Raising)
          assert Server.generate(server, "Colors: red,", max_tokens: 6) == {:ok, want}
          assert Server.generate(server, "Colors: red,", max_tokens: 6) == {:ok, want}
          assert Process.alive?(server)
        end)

      assert_receive {:telemetry, _, %{count: 1},
                      %{strategy: C.Raising, kind: :error, reason: %KeyError{}}}

      # logged once, however many ticks failed
      assert length(String.split(log, "batch strategy")) == 2
    end
  end

  describe "MTP sessions" do
    alias LlamaCppEx.MTP

    setup %{path: path} do
      {:ok, draft} = Model.load(path, load_mtp: true)
      %{draft: draft}
    end

    test "init/2 validates in the contract's order", %{model: model, draft: draft, path: path} do
      for bad <- [0, -1, 1.5, "3", :three, nil, [1]] do
        assert MTP.init(model, n_draft: bad, draft_model: draft) ==
                 {:error, ":n_draft must be a positive integer"}
      end

      assert {:error, ":draft_model must be a LlamaCppEx.Model, got: " <> _} =
               MTP.init(model, draft_model: "draft.gguf")

      assert {:error, "draft_model was loaded without load_mtp: true" <> _} =
               MTP.init(model, draft_model: model)

      assert {:error, "model was loaded without load_mtp: true" <> msg} = MTP.init(model)
      assert msg =~ "reload it"

      assert {:error, "model was loaded without load_mtp: true" <> _} =
               MTP.init(model, draft_model: nil)

      {:ok, with_head_asked} = Model.load(path, load_mtp: true)

      assert {:error, "this GGUF contains no MTP head (0 nextn layers)" <> msg} =
               MTP.init(with_head_asked)

      assert msg =~ "MTP-preserving conversion" and msg =~ "draft_model"

      {:ok, gemma} = Model.load(TestModels.gemma3_path(), load_mtp: true)

      assert {:error, "failed to attach the draft model" <> _} =
               MTP.init(model, draft_model: gemma)
    end

    test "a draft-model session generates the text of plain decoding, again and again",
         %{model: model, draft: draft} do
      {:ok, mtp} = MTP.init(model, draft_model: draft, n_draft: 4, n_ctx: 512)
      prompt = "Count with me: one, two, three, four,"
      {:ok, want} = LlamaCppEx.generate(model, prompt, max_tokens: 24, temp: 0.0)
      assert MTP.generate(mtp, prompt, max_tokens: 24, temp: 0.0) == {:ok, want}
      assert mtp |> MTP.stream(prompt, max_tokens: 24, temp: 0.0) |> Enum.join() == want
      # abandoning a stream leaves the session usable
      assert [_, _] = mtp |> MTP.stream(prompt, max_tokens: 24, temp: 0.0) |> Enum.take(2)
      assert MTP.generate(mtp, prompt, max_tokens: 24, temp: 0.0) == {:ok, want}

      s = MTP.stats(mtp)
      assert s.n_draft == 4 and s.iters > 0 and s.tokens_emitted >= 3 * 24
      assert s.drafts_accepted > 0 and s.drafts_accepted <= s.drafts_generated
      assert s.acceptance_rate > 0.5
      assert s.timing_us.total >= s.timing_us.draft + s.timing_us.verify
      printed = ExUnit.CaptureIO.capture_io(fn -> assert :ok = MTP.print_stats(mtp) end)
      assert printed =~ "drafts accepted" and printed =~ "(n_draft 4)"
    end

    test "stream_events: tokens with ids, stats, an exact max_tokens, terminal events",
         %{model: model, draft: draft} do
      {:ok, mtp} = MTP.init(model, draft_model: draft, n_draft: 3, n_ctx: 512)
      prompt = "Count with me: one, two, three, four,"

      for n <- [1, 4, 16] do
        events = mtp |> MTP.stream_events(prompt, max_tokens: n, temp: 0.0) |> Enum.to_list()
        tokens = for {:token, id, piece} <- events, do: {id, piece}
        assert length(tokens) == n
        assert Enum.all?(tokens, fn {id, p} -> is_integer(id) and is_binary(p) end)
        assert {:done, %{tokens_emitted: _}} = List.last(events)
      end

      {:ok, ids} = LlamaCppEx.Tokenizer.encode(model, "Hello")
      events = mtp |> MTP.stream_events(ids, max_tokens: 9, emit_stats_every: 4) |> Enum.to_list()
      assert length(for {:stats, %{iters: _}} <- events, do: 1) == 2

      events =
        mtp
        |> MTP.stream_events("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
          max_tokens: 200,
          temp: 0.0
        )
        |> Enum.to_list()

      assert List.last(events) == {:eog, nil}

      assert mtp |> MTP.stream_events("x", grammar: "root ::= (") |> Enum.to_list() ==
               [{:error, :invalid_grammar}]

      assert mtp |> MTP.stream_events("x", timeout: 0) |> Enum.to_list() |> List.last() ==
               {:error, :timeout}
    end
  end

  describe "RPC" do
    alias LlamaCppEx.RPC

    test "answers as llama_cpp_ex built without ggml-rpc", %{path: path} do
      refute RPC.supported?()
      assert RPC.add_server("10.0.0.2:50052") == {:error, :rpc_unsupported}
      assert RPC.add_servers([]) == {:ok, 0}

      assert RPC.add_servers(["10.0.0.2:50052", "10.0.0.3:50052"]) ==
               {:error, {"10.0.0.2:50052", :rpc_unsupported}}

      assert RPC.devices() == []
      assert RPC.ping("10.0.0.2:50052") == {:error, :rpc_unsupported}

      assert RPC.Server.start_link(endpoint: "127.0.0.1:50052") ==
               {:error, {:rpc, :rpc_unsupported}}

      assert RPC.Server.child_spec(endpoint: "x").restart == :temporary

      assert_raise ArgumentError, ~r/unknown option: :port/, fn ->
        RPC.Server.start_link(endpoint: "127.0.0.1:50052", port: 1)
      end

      assert {:error, "RPC endpoint \"10.0.0.2:50052\": rpc_unsupported" <> _} =
               Model.load(path, rpc_servers: ["10.0.0.2:50052"])
    end
  end

  describe "the Hub" do
    setup do
      cache =
        Path.join(System.tmp_dir!(), "llama_cpp_ex_dropin_#{System.unique_integer([:positive])}")

      on_exit(fn -> File.rm_rf!(cache) end)
      %{opts: [cache_dir: cache, verify_checksum: false]}
    end

    test "rejected paths answer in the contract's words, with no request made", %{opts: opts} do
      client = fn _url, _ -> flunk("no request for a rejected path") end
      opts = [http_client: client] ++ opts

      for {repo, file, start} <- [
            {"../evil", "m.gguf", "invalid repository id"},
            {"org/m", "/etc/passwd", "invalid filename"},
            {"org/m", "a\\b.gguf", "invalid filename"},
            {"org/m", "", "invalid filename"},
            {"org/m", "~/m.gguf", "invalid filename"}
          ] do
        assert {:error, msg} = Hub.download(repo, file, opts)
        assert String.starts_with?(msg, start), msg
      end

      assert {:error, "invalid revision" <> _} =
               Hub.download("org/m", "m.gguf", [revision: ".."] ++ opts)

      assert {:error, "invalid filename: must not be empty"} = Hub.download("org/m", "", opts)

      assert_raise ArgumentError, ~r/^invalid repository id 42: expected a string/, fn ->
        Hub.cache_path(42, "m.gguf")
      end
    end

    test "a custom :http_client streams through the contract's into: callback", %{opts: opts} do
      chunks = for i <- 1..1000, do: :binary.copy(<<rem(i, 256)>>, 100)
      body = IO.iodata_to_binary(chunks)
      parent = self()

      client = fn _url, req_opts ->
        into = Keyword.fetch!(req_opts, :into)
        resp = %{status: 200, headers: [{"content-length", "#{byte_size(body)}"}], body: ""}

        Enum.reduce(chunks, {:req, resp}, fn chunk, acc ->
          {:cont, acc} = into.({:data, chunk}, acc)
          acc
        end)

        {:ok, resp}
      end

      progress = fn p -> send(parent, {:progress, p}) end

      assert {:ok, path} =
               Hub.download("org/m", "m.gguf", [http_client: client, progress: progress] ++ opts)

      assert File.read!(path) == body
      reports = collect_progress([])
      # a human rate: far fewer calls than the 1000 chunks, the last one complete
      assert length(reports) <= 110
      assert List.last(reports) == {byte_size(body), byte_size(body)}

      # a client that returns the body instead of streaming it works too; a non-200 body is
      # never written
      whole = fn _url, _ -> {:ok, %{status: 200, headers: [], body: "whole body"}} end
      assert {:ok, p2} = Hub.download("org/m", "w.gguf", [http_client: whole] ++ opts)
      assert File.read!(p2) == "whole body"

      denied = fn _url, req_opts ->
        Keyword.fetch!(req_opts, :into).({:data, "<html>denied</html>"}, {:req, %{status: 403}})
        {:ok, %{status: 403, headers: [], body: ""}}
      end

      assert {:error, "access denied" <> _} =
               Hub.download("org/m", "d.gguf", [http_client: denied] ++ opts)

      refute File.exists?(Hub.cache_path("org/m", "d.gguf", opts))
      assert Path.wildcard(Path.join(opts[:cache_dir], "**/*.part")) == []
    end
  end

  defp collect_progress(acc) do
    receive do
      {:progress, p} -> collect_progress([p | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end
end
