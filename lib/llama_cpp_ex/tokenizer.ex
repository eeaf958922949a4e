defmodule LlamaCppEx.Tokenizer do
  @moduledoc """
  The model's tokenizer, rebuilt from GGUF metadata; ids match llama.cpp's.

  ## Example

      {:ok, ids} = LlamaCppEx.Tokenizer.encode(model, "Hello world")
      {:ok, "Hello world"} = LlamaCppEx.Tokenizer.decode(model, ids)
  """

  alias LlamaCppEx.{Model, NIF, Options}

  @doc """
  Tokenizes `text`.

  ## Options

    * `:add_special` - add BOS/EOS as the model's metadata asks. Default `true`.
    * `:parse_special` - turn special-token text (`<|im_start|>`) into special tokens.
      Default `true`.
  """
  @spec encode(Model.t(), String.t(), keyword()) ::
          {:ok, [non_neg_integer()]} | {:error, String.t()}
  def encode(%Model{ref: ref}, text, opts \\ []) do
    Options.validate!(opts, [:add_special, :parse_special], "LlamaCppEx.Tokenizer.encode/3")

    with :ok <- Options.check_all(opts, add_special: :boolean, parse_special: :boolean),
         true <-
           is_binary(text) ||
             {:error, "tokenize failed: text must be a binary, got #{inspect(text)}"} do
      NIF.tokenize(
        ref,
        text,
        Keyword.get(opts, :add_special, true),
        Keyword.get(opts, :parse_special, true)
      )
    end
  end

  @doc """
  Detokenizes `tokens` (special tokens render as their text). Out-of-range or negative ids
  give `{:error, reason}`. The result may end in an incomplete UTF-8 sequence when the ids
  stop mid-character.
  """
  @spec decode(Model.t(), [integer()]) :: {:ok, binary()} | {:error, String.t()}
  def decode(%Model{ref: ref}, tokens) do
    with :ok <- check_ids(tokens), do: NIF.detokenize(ref, tokens)
  end

  @max_id 0xFFFF_FFFF

  @doc false
  # Rejects terms the NIF could not decode as 64-bit integers, with a readable message; range
  # checks against the vocabulary happen natively.
  @spec check_ids(term()) :: :ok | {:error, String.t()}
  def check_ids(tokens) when is_list(tokens) do
    case Enum.find(tokens, &(not is_integer(&1) or &1 < 0 or &1 > @max_id)) do
      nil -> :ok
      bad -> {:error, "invalid token id #{inspect(bad)}"}
    end
  end

  def check_ids(other), do: {:error, "token ids must be a list, got #{inspect(other)}"}

  @doc "The bytes token `token` renders as. Raises `ArgumentError` for an invalid id."
  @spec token_to_piece(Model.t(), integer()) :: binary()
  def token_to_piece(%Model{ref: ref}, token) do
    with :ok <- check_ids([token]),
         {:ok, piece} <- NIF.token_to_piece(ref, token) do
      piece
    else
      {:error, msg} -> raise ArgumentError, msg
    end
  end

  @doc "Vocabulary size."
  @spec vocab_size(Model.t()) :: pos_integer()
  def vocab_size(model), do: Model.info(model).n_vocab

  @doc "Beginning-of-sequence token id (-1 when the model has none)."
  @spec bos_token(Model.t()) :: integer()
  def bos_token(model), do: Model.info(model).bos

  @doc "End-of-sequence token id (-1 when the model has none)."
  @spec eos_token(Model.t()) :: integer()
  def eos_token(model), do: Model.info(model).eos

  @doc "Whether `token` ends generation (EOS, EOT, `<|im_end|>`, `<end_of_turn>`, ...)."
  @spec eog?(Model.t(), integer()) :: boolean()
  def eog?(%Model{ref: ref}, token) when is_integer(token) do
    check_ids([token]) == :ok and NIF.vocab_is_eog(ref, token)
  end
end
