defmodule LlamaCppExTest do
  use ExUnit.Case, async: false

  alias LlamaCppEx.{Context, Model, Sampler, TestModels, Tokenizer}

  setup_all do
    %{model: TestModels.smollm2()}
  end

  test "init is idempotent and devices lists the CPU" do
    assert LlamaCppEx.init() == :ok
    assert LlamaCppEx.init() == :ok
    assert [%{type: :cpu, backend: "CPU", gpu_index: nil, index: 0} = cpu] = LlamaCppEx.devices()
    assert cpu.memory_total > 0
  end

  @gpus Enum.filter(LlamaCppEx.devices(), &(&1.type == :gpu))
  if @gpus == [],
    do: @tag(skip: "no GPU here (a CPU build, or no NVIDIA driver): see scripts/gpu_check.sh")

  # parity with llama.cpp on the GPU is the engine's (arch_parity under the cuda backend);
  # here the placement end to end
  test "a CUDA build runs a decoder on its GPU" do
    path = TestModels.smollm2_path()
    {:ok, gpu} = Model.load(path)
    {:ok, cpu} = Model.load(path, n_gpu_layers: 0)
    assert Model.backend(gpu) == hd(@gpus).name
    assert Model.backend(cpu) == "CPU"
    opts = [max_tokens: 16, temp: 0.0]

    assert LlamaCppEx.generate(gpu, "The capital of France is", opts) ==
             LlamaCppEx.generate(cpu, "The capital of France is", opts)
  end

  test "model accessors", %{model: model} do
    assert Model.desc(model) == "llama 135M Q4_1"
    assert Model.n_ctx_train(model) == 8192
    assert Model.n_embd(model) == 576
    assert Model.n_layer(model) == 30
    assert Model.n_params(model) > 130_000_000
    assert Model.size(model) > 90_000_000
    assert Model.architecture(model) == "llama"
    assert Model.chat_template(model) =~ "<|im_start|>"
    assert Model.metadata(model)["llama.block_count"] == "30"
    assert Model.backend(model) == "CPU"
  end

  # the CPU build (the test build) on any machine: placement options are a documented no-op,
  # and checked like every option
  test "placement options load on the CPU in a CPU build" do
    path = TestModels.smollm2_path()
    assert Enum.all?(LlamaCppEx.devices(), &(&1.type == :cpu)), "a GPU build: see gpu_check"

    for opts <- [[n_gpu_layers: 0], [n_gpu_layers: -1], [n_gpu_layers: 5, main_gpu: 3]] do
      assert {:ok, m} = Model.load(path, opts)
      assert Model.backend(m) == "CPU"
    end

    assert {:error, "invalid n_gpu_layers" <> _} = Model.load(path, n_gpu_layers: "all")
    assert {:error, "invalid main_gpu" <> _} = Model.load(path, main_gpu: -1)
  end

  test "generate with temp 0 is deterministic and matches the stream", %{model: model} do
    opts = [max_tokens: 24, temp: 0.0]
    assert {:ok, text} = LlamaCppEx.generate(model, "The capital of France is", opts)
    assert text =~ "Paris"
    assert {:ok, ^text} = LlamaCppEx.generate(model, "The capital of France is", opts)

    chunks = model |> LlamaCppEx.stream("The capital of France is", opts) |> Enum.to_list()
    assert Enum.all?(chunks, &(is_binary(&1) and &1 != ""))
    assert Enum.join(chunks) == text
  end

  test "file weight types without re-quantization reproduce llama.cpp's greedy text" do
    {:ok, model} = LlamaCppEx.load_model(TestModels.smollm2_path(), requantize: false)

    {:ok, text} =
      LlamaCppEx.generate(model, "The capital of France is", max_tokens: 12, temp: 0.0)

    # llama.cpp's first greedy tokens on this file (test/fixtures/greedy_SmolLM2...json)
    assert String.starts_with?(text, " Paris.\n\nThe United States has a population")
  end

  test "a seeded sampler is reproducible", %{model: model} do
    opts = [max_tokens: 16, temp: 0.9, seed: 1234]
    {:ok, a} = LlamaCppEx.generate(model, "Once upon a time", opts)
    {:ok, b} = LlamaCppEx.generate(model, "Once upon a time", opts)
    assert a == b
  end

  test "max_tokens bounds the generated tokens", %{model: model} do
    {:ok, ctx} = Context.create(model, n_ctx: 256)
    {:ok, sampler} = Sampler.create(model, temp: 0.0)
    {:ok, tokens} = Tokenizer.encode(model, "Count: 1, 2, 3,")
    {:ok, text} = Context.generate(ctx, sampler, tokens, max_tokens: 5)
    {:ok, ids} = Tokenizer.encode(model, text, add_special: false)
    assert length(ids) <= 6
  end

  test "Enum.take/2 halts the stream and stops native generation", %{model: model} do
    # the stream is driven by its consumer one step at a time: halting it leaves no work
    assert [_, _, _] =
             model
             |> LlamaCppEx.stream("Once upon a time", max_tokens: 400, temp: 0.0)
             |> Enum.take(3)

    # Context.generate/4: raising its cancel flag from another process stops it before its
    # next step, with the text so far (1500 tokens would take seconds; it stops far sooner)
    {:ok, ctx} = Context.create(model, n_ctx: 2048)
    {:ok, sampler} = Sampler.create(model, temp: 0.0)
    {:ok, tokens} = Tokenizer.encode(model, "Count: 1, 2, 3,")
    cancel = Context.cancel_flag()

    task =
      Task.async(fn ->
        Context.generate(ctx, sampler, tokens, max_tokens: 1500, cancel: cancel)
      end)

    Process.sleep(200)
    :ok = Context.cancel(cancel)
    assert {:ok, text} = Task.await(task, 60_000)
    {:ok, ids} = Tokenizer.encode(model, text, add_special: false)
    assert length(ids) < 1500

    # a flag raised before the call stops it before the first forward pass
    assert {:ok, ""} = Context.generate(ctx, sampler, tokens, max_tokens: 400, cancel: cancel)
  end

  test "stream chunks are valid UTF-8 even when tokens split codepoints", %{model: model} do
    opts = [max_tokens: 24, temp: 0.0]
    prompt = "日本語のテキストです。そして"
    chunks = model |> LlamaCppEx.stream(prompt, opts) |> Enum.to_list()
    {:ok, text} = LlamaCppEx.generate(model, prompt, opts)
    assert Enum.join(chunks) == text
    # only a final flush of a codepoint cut off by max_tokens may be incomplete
    assert chunks |> Enum.drop(-1) |> Enum.all?(&String.valid?/1)
    # Japanese output is made of multi-byte pieces split across tokens
    assert Enum.any?(chunks, &(byte_size(&1) >= 3))
  end

  test "a stream timeout yields {:error, :timeout}", %{model: model} do
    assert [{:error, :timeout}] =
             model |> LlamaCppEx.stream("Hello", max_tokens: 8, timeout: 0) |> Enum.take(1)
  end

  test "streams report setup errors as a single element", %{model: model} do
    assert [{:error, msg}] = model |> LlamaCppEx.stream("Hello", max_tokens: 0) |> Enum.to_list()
    assert msg =~ "max_tokens"
    assert [{:error, _}] = model |> LlamaCppEx.stream("", max_tokens: 4) |> Enum.to_list()
  end

  test "unknown options raise with a hint", %{model: model} do
    error =
      assert_raise ArgumentError, fn -> LlamaCppEx.generate(model, "x", temperature: 0.1) end

    assert error.message =~ "unknown option: :temperature (did you mean :temp?)"

    assert_raise ArgumentError, ~r/cannot use both :grammar and :json_schema/, fn ->
      LlamaCppEx.generate(%Model{ref: nil}, "x", grammar: "root ::= \"a\"", json_schema: %{})
    end

    assert_raise ArgumentError, ~r/unknown option: :n_paralell/, fn ->
      Context.create(model, n_paralell: 2)
    end
  end
end
