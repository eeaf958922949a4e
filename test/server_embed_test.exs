defmodule LlamaCppEx.ServerEmbedTest do
  # Server.embed/3: embedding texts riding in the generation forward passes.
  use ExUnit.Case, async: false
  import LlamaCppEx.Eventually, only: [wait_until: 1]

  alias LlamaCppEx.{Server, TestModels}

  @moduletag timeout: 600_000

  @texts [
    "The cat sat on the mat.",
    "Paris is the capital of France.",
    "A journey of a thousand miles begins with a single step.",
    "Rust and Elixir meet in a NIF."
  ]

  setup_all do
    {server, model} =
      TestModels.start_server(
        n_parallel: 2,
        n_ctx: 2048,
        n_batch: 256,
        embed_parallel: 3,
        temp: 0.0
      )

    %{server: server, model: model}
  end

  defp cosine(a, b) do
    dot = Enum.zip_reduce(a, b, 0.0, fn x, y, acc -> acc + x * y end)
    norm = fn v -> :math.sqrt(Enum.reduce(v, 0.0, &(&1 * &1 + &2))) end
    dot / (norm.(a) * norm.(b))
  end

  defp assert_same_vectors(got, want, bound \\ 0.9999) do
    assert length(got) == length(want)

    for {g, w} <- Enum.zip(got, want) do
      c = cosine(g, w)
      assert c > bound, "cosine #{c}"
    end
  end

  defp attach(events), do: TestModels.attach_telemetry(events)

  test "vectors equal the model route's, in order, and nothing stays in the cache", %{
    server: server,
    model: model
  } do
    attach([[:llama_cpp_ex, :server, :embed, :done], [:llama_cpp_ex, :server, :tick]])
    {:ok, want} = LlamaCppEx.embed_batch(model, @texts)
    # four texts, three embedding sequences: two passes
    assert {:ok, got} = Server.embed(server, @texts)
    assert_same_vectors(got, want)
    assert length(hd(got)) == LlamaCppEx.Model.n_embd(model)

    assert_receive {:telemetry, [:llama_cpp_ex, :server, :embed, :done], m, %{server: ^server}}
    assert m.texts == 4 and m.tokens > 20 and m.duration_ms >= 0

    assert_received {:telemetry, [:llama_cpp_ex, :server, :tick], %{embed_tokens: n}, _}
                    when n > 0

    {:ok, last} = LlamaCppEx.embed_batch(model, @texts, pooling_type: :last, normalize: -1)

    assert {:ok, got} =
             Server.embed(server, @texts, pooling_type: :last, normalize: -1, format: :binary)

    assert_same_vectors(Enum.map(got, &for(<<x::float-32-native <- &1>>, do: x)), last)

    stats = Server.get_stats(server)
    assert stats.embeddings_completed >= 8
    assert stats.embed_queue_depth == 0
    {:ok, audit} = Server.kv_audit(server)
    # only slots (0, 1) may hold blocks: the embedding sequences were cleared
    for [{seq, _blocks} | _] <- audit.owners, do: assert(seq < 2)
    for owners <- audit.owners, {seq, _} <- owners, do: assert(seq < 2)
  end

  test "generation is unchanged by embedding traffic in the same passes", %{server: server} do
    prompt = "Write a short poem about the sea."
    {:ok, alone} = Server.generate(server, prompt, max_tokens: 24, cache_prompt: false)

    stream =
      Task.async(fn ->
        server
        |> Server.stream(prompt, max_tokens: 24, cache_prompt: false)
        |> Enum.join()
      end)

    embedders =
      for i <- 1..4 do
        Task.async(fn -> Server.embed(server, Enum.map(@texts, &"#{&1} (#{i})")) end)
      end

    for t <- embedders, do: assert({:ok, [_, _, _, _]} = Task.await(t, 120_000))
    assert Task.await(stream, 120_000) == alone
  end

  test "bad inputs are errors; the server keeps serving", %{server: server} do
    assert {:ok, []} = Server.embed(server, [])
    assert {:error, "cannot embed an empty text"} = Server.embed(server, ["a", ""])
    assert {:error, "texts must be binaries" <> _} = Server.embed(server, [:a])

    assert_raise ArgumentError, ~r/unknown option.*:bogus|:bogus/, fn ->
      Server.embed(server, ["a"], bogus: 1)
    end

    long = String.duplicate("word ", 400)
    # longer than n_batch (256): an error, or its first tokens with truncate: true
    assert {:error, "text 0 has " <> _} = Server.embed(server, [long])
    assert {:ok, [v]} = Server.embed(server, [long], truncate: true)
    assert length(v) == 576

    assert {:error, message} = Server.embed(server, ["a"], pooling_type: :rank)
    assert message =~ "classification head"
    assert {:ok, [_]} = Server.embed(server, ["still serving"])
  end

  test "a call that times out or whose caller dies is dropped", %{server: server} do
    many = for i <- 1..60, do: "sentence number #{i} about nothing in particular"
    assert {:error, :timeout} = Server.embed(server, many, timeout: 0)

    pid = spawn(fn -> Server.embed(server, many) end)
    Process.sleep(20)
    Process.exit(pid, :kill)
    assert {:ok, [_]} = Server.embed(server, ["after"])
    Process.sleep(50)
    assert Server.get_stats(server).embed_queue_depth == 0
  end

  test "max_queue bounds waiting calls" do
    {:ok, server} =
      Server.start_link(
        model_path: TestModels.smollm2_path(),
        n_parallel: 1,
        n_ctx: 1024,
        max_queue: 1,
        embed_parallel: 1
      )

    {:ok, _} = TestModels.wait_model(server)
    many = for i <- 1..40, do: "text #{i}"
    # paused, the first call's job stays registered until the probe has been answered
    :ok = Server.pause(server)
    first = Task.async(fn -> Server.embed(server, many) end)
    wait_until(fn -> Server.get_stats(server).embed_queue_depth == 40 end)
    assert {:error, :queue_full} = Server.embed(server, ["one more"])
    :ok = Server.resume(server)
    assert {:ok, vectors} = Task.await(first, 60_000)
    assert length(vectors) == 40
    GenServer.stop(server)
  end

  test "an encoder server embeds and refuses generation" do
    dir = Path.join(TestModels.dir(), "all-minilm-l6-v2")
    {:ok, minilm} = LlamaCppEx.load_model(dir, quantize: :none)

    {:ok, server} =
      Server.start_link(model_path: dir, quantize: :none, n_parallel: 1, n_ctx: 2048)

    {:ok, _} = TestModels.wait_model(server)
    texts = for i <- 1..40, do: "sentence #{i}: #{Enum.at(@texts, rem(i, 4))}"
    {:ok, want} = LlamaCppEx.embed_batch(minilm, texts)
    assert {:ok, got} = Server.embed(server, texts)
    assert_same_vectors(got, want, 0.99999)
    assert {:error, :not_generative_model} = Server.generate(server, "hello")
    GenServer.stop(server)
  end

  test "an EmbeddingGemma-style model (bidirectional decoder) embeds like llama.cpp, alone or in a server" do
    path = Path.expand("fixtures/tiny/tiny-gemma-embedding-f32.gguf", __DIR__)

    {:ok, fx} =
      LlamaCppEx.JSON.decode(File.read!(Path.expand("fixtures/tiny/bert.json", __DIR__)))

    %{"texts" => texts, "embeddings" => want} = fx["gemma_embedding"]
    {:ok, model} = LlamaCppEx.load_model(path)
    refute LlamaCppEx.Model.info(model).generative
    {:ok, got} = LlamaCppEx.embed_batch(model, texts)
    assert_same_vectors(got, want)
    assert {:error, :not_generative_model} = LlamaCppEx.generate(model, "hello", max_tokens: 2)

    {:ok, server} = Server.start_link(model_path: path, n_parallel: 1, n_ctx: 512)
    {:ok, _} = TestModels.wait_model(server)
    assert {:ok, got} = Server.embed(server, texts)
    assert_same_vectors(got, want)
    assert {:error, :not_generative_model} = Server.generate(server, "hello")
    GenServer.stop(server)
  end
end
