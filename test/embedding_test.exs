defmodule LlamaCppEx.EmbeddingTest do
  @moduledoc """
  `LlamaCppEx.embed/3` and `embed_batch/3` on SmolLM2 (the vectors' parity with llama.cpp's
  `llama-embedding` is checked by the engine's `tests/embeddings.rs`).
  """
  use ExUnit.Case, async: true

  alias LlamaCppEx.{Model, TestModels}

  setup_all do
    %{model: TestModels.smollm2()}
  end

  defp cosine(a, b) do
    dot = Enum.zip_with(a, b, &(&1 * &2)) |> Enum.sum()
    norm = fn v -> v |> Enum.map(&(&1 * &1)) |> Enum.sum() |> :math.sqrt() end
    dot / (norm.(a) * norm.(b))
  end

  test "embed gives an L2-normalised vector of n_embd floats", %{model: model} do
    {:ok, v} = LlamaCppEx.embed(model, "The capital of France is Paris.")
    assert length(v) == Model.n_embd(model)
    assert_in_delta :math.sqrt(Enum.sum(Enum.map(v, &(&1 * &1)))), 1.0, 1.0e-4
  end

  test "embed_batch equals embed per text, and similar texts are closer", %{model: model} do
    texts = ["I love cats.", "I adore kittens.", "The stock market fell today."]
    {:ok, batch} = LlamaCppEx.embed_batch(model, texts)

    for {text, v} <- Enum.zip(texts, batch) do
      {:ok, alone} = LlamaCppEx.embed(model, text)
      assert cosine(alone, v) > 0.99999
    end

    [cats, kittens, market] = batch
    assert cosine(cats, kittens) > cosine(cats, market)
  end

  test "poolings, formats and normalisation", %{model: model} do
    d = Model.n_embd(model)
    {:ok, bin} = LlamaCppEx.embed(model, "hello", format: :binary)
    assert byte_size(bin) == 4 * d
    {:ok, rows} = LlamaCppEx.embed(model, "hello world", pooling_type: :none)
    {:ok, ids} = LlamaCppEx.Tokenizer.encode(model, "hello world")
    assert length(rows) == length(ids) and Enum.all?(rows, &(length(&1) == d))
    {:ok, raw} = LlamaCppEx.embed(model, "hello", normalize: -1, pooling_type: :last)
    assert :math.sqrt(Enum.sum(Enum.map(raw, &(&1 * &1)))) > 1.5
  end

  test "bad input is an error, unknown options raise", %{model: model} do
    assert {:error, "cannot embed an empty text"} = LlamaCppEx.embed(model, "")
    assert {:error, msg} = LlamaCppEx.embed(model, String.duplicate("word ", 100), n_ctx: 16)
    assert msg =~ "n_ctx"

    assert {:ok, _} =
             LlamaCppEx.embed(model, String.duplicate("word ", 100), n_ctx: 16, truncate: true)

    assert {:error, _} = LlamaCppEx.embed(model, "x", pooling_type: :rank)
    assert {:error, _} = LlamaCppEx.embed(model, "x", normalize: 2 ** 70)

    assert_raise ArgumentError, ~r/unknown option: :pooling/, fn ->
      LlamaCppEx.embed(model, "x", pooling: :mean)
    end
  end

  describe "a BERT encoder (all-MiniLM-L6-v2, Hugging Face layout)" do
    setup do
      dir = Path.join(TestModels.dir(), "all-minilm-l6-v2")
      # an encoder directory loads unquantized by default
      {:ok, minilm} = LlamaCppEx.load_model(dir)
      %{minilm: minilm}
    end

    test "embeds like the float64 reference, one text or many per pass", %{minilm: minilm} do
      fx =
        Path.expand("fixtures/minilm_embeddings.json", __DIR__)
        |> File.read!()
        |> LlamaCppEx.JSON.decode()
        |> elem(1)

      assert Model.architecture(minilm) == "bert"
      {:ok, batch} = LlamaCppEx.embed_batch(minilm, fx["texts"])

      for {v, want} <- Enum.zip(batch, fx["embeddings"]) do
        assert length(v) == 384
        assert cosine(v, want) > 0.99999
      end

      [first | _] = fx["texts"]
      {:ok, alone} = LlamaCppEx.embed(minilm, first)
      assert cosine(alone, hd(batch)) > 0.99999
    end

    test "thousands of texts go in bounded passes; bad inputs are errors", %{minilm: minilm} do
      texts = for i <- 1..2000, do: "note #{i}"
      assert {:ok, vectors} = LlamaCppEx.embed_batch(minilm, texts)
      assert length(vectors) == 2000
      {:ok, last} = LlamaCppEx.embed(minilm, List.last(texts))
      assert cosine(List.last(vectors), last) > 0.99999

      assert {:ok, []} = LlamaCppEx.embed_batch(minilm, [])
      assert {:error, _} = LlamaCppEx.embed(minilm, <<0xFF, 0xFE, 0x41>>)
      assert {:error, _} = LlamaCppEx.embed_batch(minilm, ["ok", :not_text])
      assert {:error, msg} = LlamaCppEx.embed(minilm, "x", pooling_type: :rank)
      assert msg =~ "classification head"
      assert {:error, msg} = LlamaCppEx.rerank(minilm, "q", ["d"])
      assert msg =~ "classification head"
    end

    test "limits and misuse are errors", %{minilm: minilm} do
      long = String.duplicate("word ", 600)
      assert {:error, msg} = LlamaCppEx.embed(minilm, long)
      assert msg =~ "512"
      assert {:ok, [_ | _]} = LlamaCppEx.embed(minilm, long, truncate: true)
      assert {:error, "cannot embed an empty text"} = LlamaCppEx.embed(minilm, "")
      assert {:error, :not_generative_model} = LlamaCppEx.generate(minilm, "hello", max_tokens: 4)
    end
  end

  describe "BERT GGUFs and reranking (tiny models, llama.cpp's outputs in test/fixtures/tiny)" do
    setup do
      fx =
        Path.expand("fixtures/tiny/bert.json", __DIR__)
        |> File.read!()
        |> LlamaCppEx.JSON.decode()
        |> elem(1)

      %{fx: fx, dir: Path.expand("fixtures/tiny", __DIR__)}
    end

    test "a bert GGUF embeds like llama-embedding", %{fx: fx, dir: dir} do
      {:ok, bert} = LlamaCppEx.load_model(Path.join(dir, "tiny-bert-f32.gguf"))

      for {text, want} <- Enum.zip(fx["texts"], fx["embeddings"]) do
        {:ok, v} = LlamaCppEx.embed(bert, text)
        assert cosine(v, want) > 0.999
      end

      assert {:error, msg} = LlamaCppEx.rerank(bert, "q", ["d"])
      assert msg =~ "classification head"
    end

    test "rerank gives llama-server's relevance scores in document order", %{fx: fx, dir: dir} do
      {:ok, reranker} = LlamaCppEx.load_model(Path.join(dir, "tiny-bert-rerank-f32.gguf"))
      %{"query" => q, "documents" => docs, "scores" => want} = fx["rerank"]
      assert {:ok, scores} = LlamaCppEx.rerank(reranker, q, docs)

      for {got, w} <- Enum.zip(scores, want), do: assert_in_delta(got, w, 5.0e-3)

      assert {:ok, [_]} = LlamaCppEx.embed_batch(reranker, ["x"], pooling_type: :rank)

      # a Qwen3-Reranker-style decoder: its rerank template, last token, softmax over yes/no
      {:ok, qwen} = LlamaCppEx.load_model(Path.join(dir, "tiny-qwen3-rerank-f32.gguf"))
      %{"query" => q3, "documents" => d3, "scores" => w3} = fx["qwen3_rerank"]
      assert {:ok, s3} = LlamaCppEx.rerank(qwen, q3, d3)
      for {got, w} <- Enum.zip(s3, w3), do: assert_in_delta(got, w, 1.0e-3)
      assert {:error, _} = LlamaCppEx.rerank(reranker, "", docs)
      assert {:error, _} = LlamaCppEx.rerank(reranker, q, [<<0xFF>>])
    end
  end
end
