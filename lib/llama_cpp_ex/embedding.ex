defmodule LlamaCppEx.Embedding do
  @moduledoc """
  Text embeddings from a loaded model.

  Each text is tokenized (with the model's BOS, as `llama-embedding` does) and evaluated; the
  final-normed hidden states of its tokens are pooled into one vector and normalised.
  `embed_batch/3` evaluates many texts per forward pass, each as its own sequence (attention
  within each text), in passes of up to 4096 tokens, so a batch costs about as much as its
  texts together and memory stays bounded however many texts there are.

      {:ok, model} = LlamaCppEx.load_model("SmolLM2-135M-Instruct.Q4_1.gguf")
      {:ok, v} = LlamaCppEx.embed(model, "The capital of France is Paris.")
      length(v) == LlamaCppEx.Model.n_embd(model)
      {:ok, [a, b]} = LlamaCppEx.embed_batch(model, ["cats", "dogs"], pooling_type: :last)

  ## Encoders

  BERT-family encoders load from a Hugging Face directory (sentence-transformers layout:
  all-MiniLM-L6-v2, bge, e5, ...) and embed through the same calls; their attention is
  bidirectional within each text, the pooling is the directory's (`1_Pooling/config.json`,
  mean otherwise), and texts are wrapped in `[CLS] … [SEP]` by the tokenizer's
  post-processor. An encoder directory loads unquantized by default, and all-MiniLM-L6-v2 then
  matches a float64 reference forward pass to cosine 1.0000000 (≥ 0.9992 with
  `quantize: :q8_0`, which halves its memory).

      {:ok, minilm} = LlamaCppEx.load_model("/models/all-MiniLM-L6-v2")
      {:ok, vectors} = LlamaCppEx.embed_batch(minilm, ["cats purr", "dogs bark"])

  ## Options

    * `:pooling_type` - `:unspecified` (default: the model's own `pooling_type` metadata,
      else `:mean`), `:mean`, `:cls` (the first token), `:last`, or `:none` (one vector per
      token: `embed/3` returns a list of vectors), or `:rank` (a reranker's scores through its
      classification head; models without one give an error). See also `rerank/4`.
    * `:normalize` - `2` (default, Euclidean), `0` (max absolute value scaled to 32760, as
      llama.cpp), `-1` (none), or another p > 0 for a p-norm.
    * `:format` - `:list` (default) or `:binary` (f32 native-endian, for `Nx.from_binary/2`).
    * `:n_ctx` - the longest text, in tokens (default 2048, at most the model's training
      context: 512 for BERT encoders such as all-MiniLM); a longer text is an error unless
      `truncate: true` keeps its first `n_ctx` tokens.
    * `:n_threads` - worker threads (default: online schedulers).

  Decoder models (every architecture of `LlamaCppEx.load_model/2`) are supported; their
  vectors match llama.cpp's `llama-embedding` (cosine ≥ 0.999 on SmolLM2, ≥ 0.995 on Gemma 3,
  whose very large hidden dimensions magnify activation rounding). BERT encoders load from
  GGUF files (llama.cpp's `bert`) and from Hugging Face directories.

  ## Reranking

  `rerank/4` scores documents against a query with a cross-encoder (a BERT reranker whose
  GGUF has pooling `rank` and a classification head): each (query, document) pair is one
  sequence of a pass, formatted as llama-server's `/v1/rerank` formats it, and the scores are
  its raw `relevance_score`s.

      {:ok, [s1, s2]} = LlamaCppEx.rerank(reranker, "what is a cat?", ["A cat is a feline.", "Paris"])
  """

  alias LlamaCppEx.{Context, Limits, Model, NIF, Options}

  @type t :: [float()] | binary()

  @pooling %{unspecified: -1, none: 0, mean: 1, cls: 2, last: 3, rank: 4}

  @defaults [
    pooling_type: :unspecified,
    normalize: 2,
    format: :list,
    truncate: false
  ]
  @keys [:n_ctx | Keyword.keys(@defaults)]
  @max_batch_sequences 64

  @doc """
  The embedding of `text`; see the module documentation for the options.
  """
  @spec embed(Model.t(), String.t(), keyword()) :: {:ok, t() | [t()]} | {:error, String.t()}
  def embed(%Model{} = model, text, opts \\ []) do
    with {:ok, [v]} <- run(model, [text], opts, "LlamaCppEx.Embedding.embed/3"), do: {:ok, v}
  end

  @doc """
  The embeddings of `texts`, in order, from forward passes of up to 4096 tokens; results
  equal `embed/3` on each text (cosine > 0.99999). Options as `embed/3`, plus
  `:max_batch_sequences` (default 64): the most texts evaluated together, each group's
  passes finished before the next group's begin.
  """
  @spec embed_batch(Model.t(), [String.t()], keyword()) ::
          {:ok, [t() | [t()]]} | {:error, String.t()}
  def embed_batch(%Model{} = model, texts, opts \\ []) when is_list(texts) do
    run(model, texts, opts, "LlamaCppEx.Embedding.embed_batch/3", [:max_batch_sequences])
  end

  defp run(model, texts, opts, label, extra \\ []) do
    with {:ok, ids, opts} <- prepare(model, texts, opts, label, [:n_threads | extra]),
         :ok <-
           Options.check_all(opts, max_batch_sequences: {:int, 1, Limits.engine().max_sequences}) do
      ids
      |> Enum.chunk_every(opts[:max_batch_sequences] || @max_batch_sequences)
      |> Enum.reduce_while({:ok, []}, fn group, {:ok, acc} ->
        case embed_group(model, group, opts) do
          {:ok, bins} -> {:cont, {:ok, [bins | acc]}}
          error -> {:halt, error}
        end
      end)
      |> case do
        {:ok, groups} -> {:ok, groups |> Enum.reverse() |> Enum.concat() |> decode(model, opts)}
        error -> error
      end
    end
  end

  defp embed_group(model, ids, opts) do
    NIF.embed(
      model.ref,
      ids,
      pooling_code(opts),
      opts[:normalize],
      opts[:n_ctx],
      opts[:n_threads] || Context.default_threads()
    )
  end

  @doc false
  # The one home of the embedding options (checked, defaults merged, `:n_ctx` capped at the
  # model's training context and at `max_ctx`) and of turning texts into token ids, for the
  # model route and `LlamaCppEx.Server.embed/3`: `{:ok, ids, opts}` or `{:error, message}`.
  # `extra` are the caller's own option keys (validated by name only).
  @spec prepare(Model.t(), list(), keyword(), String.t(), [atom()], pos_integer() | :infinity) ::
          {:ok, [[non_neg_integer()]], keyword()} | {:error, String.t()}
  def prepare(model, texts, opts, label, extra \\ [], max_ctx \\ :infinity) do
    Options.validate!(opts, @keys ++ extra, label)

    with :ok <-
           Options.check_all(opts,
             pooling_type: {:in, Map.keys(@pooling)},
             normalize: {:int, -1, 1_000},
             format: {:in, [:list, :binary]},
             n_ctx: {:int, 1, Limits.max_context()},
             truncate: :boolean,
             n_threads: {:int, 1, 1024}
           ),
         opts = Keyword.merge(@defaults ++ [n_ctx: Limits.engine().default_context_tokens], opts),
         # never past the positions the model was trained with (an encoder has no more)
         opts = Keyword.update!(opts, :n_ctx, &min(min(&1, Model.n_ctx_train(model)), max_ctx)),
         {:ok, ids} <- tokenize_all(model, texts, opts) do
      {:ok, ids, opts}
    end
  end

  @doc false
  # llama.cpp's pooling number for the engine (-1: the model's own).
  def pooling_code(opts), do: @pooling[opts[:pooling_type]]

  @doc false
  # The engine's f32 binaries in the shape `opts` asks for.
  def decode(bins, model, opts) do
    # `:unspecified` never resolves to per-token vectors (see the engine's Pooling)
    per_token = opts[:pooling_type] == :none
    Enum.map(bins, &format(&1, opts[:format], per_token, Model.n_embd(model)))
  end

  @doc """
  Relevance scores of `documents` for `query` from a reranker, in document order:
  `{:ok, [float]}` or `{:error, message}`. Options: `:n_ctx` (the longest pair, default
  2048, at most the model's training context), `:n_threads`.
  """
  @spec rerank(Model.t(), String.t(), [String.t()], keyword()) ::
          {:ok, [float()]} | {:error, String.t()}
  def rerank(%Model{} = model, query, documents, opts \\ [])
      when is_binary(query) and is_list(documents) do
    opts =
      Options.validate!(opts, [:n_ctx, :n_threads], "LlamaCppEx.Embedding.rerank/4")
      |> Keyword.put_new(:n_ctx, Limits.engine().default_context_tokens)
      |> Keyword.update!(:n_ctx, &min(&1, Model.n_ctx_train(model)))

    cond do
      not Enum.all?([query | documents], &(is_binary(&1) and String.valid?(&1))) ->
        {:error, "query and documents must be UTF-8 strings"}

      query == "" or Enum.any?(documents, &(&1 == "")) ->
        {:error, "cannot rerank an empty query or document"}

      true ->
        NIF.rerank(
          model.ref,
          query,
          documents,
          opts[:n_ctx],
          opts[:n_threads] || Context.default_threads()
        )
    end
  end

  defp tokenize_all(model, texts, opts) do
    Enum.reduce_while(texts, {:ok, []}, fn
      text, {:ok, acc} when is_binary(text) and text != "" ->
        case NIF.tokenize(model.ref, text, true, false) do
          {:ok, ids} -> {:cont, {:ok, [fit(ids, opts) | acc]}}
          error -> {:halt, error}
        end

      "", _ ->
        {:halt, {:error, "cannot embed an empty text"}}

      other, _ ->
        {:halt, {:error, "texts must be binaries, got #{inspect(other, limit: 5)}"}}
    end)
    |> case do
      {:ok, ids} -> {:ok, Enum.reverse(ids)}
      error -> error
    end
  end

  defp fit(ids, opts) do
    if opts[:truncate], do: Enum.take(ids, opts[:n_ctx]), else: ids
  end

  defp format(bin, :binary, _per_token, _d), do: bin

  defp format(bin, :list, false, _d), do: floats(bin)

  defp format(bin, :list, true, d) do
    bin |> floats() |> Enum.chunk_every(d)
  end

  defp floats(bin), do: for(<<x::float-32-native <- bin>>, do: x)
end
