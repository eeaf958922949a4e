defmodule LlamaCppEx.GgufWriter do
  @moduledoc false
  # Writes GGUF files for tests (version 3, metadata only): chat templates
  # and metadata of our choosing.
  #
  # Values: {:u32, n} | {:i32, n} | {:u64, n} | {:f32, x} | {:bool, b} | {:string, s} |
  # {:array, :string | :i32 | :f32, [..]}.

  @doc "Writes `metadata` (`[{key, value}]`) to `path`."
  def write!(path, metadata) do
    File.write!(path, encode(metadata))
    path
  end

  @doc "The bytes of a GGUF file holding `metadata` and no tensors."
  def encode(metadata) do
    kvs = Enum.map(metadata, fn {k, v} -> [string(k), value(v)] end)

    IO.iodata_to_binary([
      "GGUF",
      <<3::little-32, 0::little-64, length(metadata)::little-64>>,
      kvs
    ])
  end

  defp string(s), do: [<<byte_size(s)::little-64>>, s]

  defp value({:u32, n}), do: <<4::little-32, n::little-32>>
  defp value({:i32, n}), do: <<5::little-32, n::little-signed-32>>
  defp value({:f32, x}), do: <<6::little-32, x::little-float-32>>
  defp value({:bool, b}), do: <<7::little-32, if(b, do: 1, else: 0)>>
  defp value({:string, s}), do: [<<8::little-32>>, string(s)]
  defp value({:u64, n}), do: <<10::little-32, n::little-64>>

  defp value({:array, type, items}) do
    {code, enc} =
      case type do
        :string -> {8, &string/1}
        :i32 -> {5, &<<&1::little-signed-32>>}
        :f32 -> {6, &<<&1::little-float-32>>}
      end

    [<<9::little-32, code::little-32, length(items)::little-64>>, Enum.map(items, enc)]
  end

  @doc """
  A vocab-only llama model: a byte-level BPE vocabulary of the printable ASCII characters
  (space as `Ġ`), `<|im_start|>`, `<|im_end|>` (EOS) and `<|endoftext|>` (BOS), and
  `chat_template` when given. `extra` entries are added (or replace these).
  """
  def tiny_vocab(chat_template \\ nil, extra \\ []) do
    chars = for c <- 33..126, do: <<c>>
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġ" | chars]
    types = [3, 3, 3 | List.duplicate(1, length(tokens) - 3)]

    base = [
      {"general.architecture", {:string, "llama"}},
      {"llama.embedding_length", {:u32, 64}},
      {"llama.block_count", {:u32, 1}},
      {"llama.attention.head_count", {:u32, 4}},
      {"llama.feed_forward_length", {:u32, 128}},
      {"llama.context_length", {:u32, 512}},
      {"tokenizer.ggml.model", {:string, "gpt2"}},
      {"tokenizer.ggml.tokens", {:array, :string, tokens}},
      {"tokenizer.ggml.token_type", {:array, :i32, types}},
      {"tokenizer.ggml.merges", {:array, :string, []}},
      {"tokenizer.ggml.bos_token_id", {:u32, 0}},
      {"tokenizer.ggml.eos_token_id", {:u32, 2}}
    ]

    base =
      if chat_template,
        do: base ++ [{"tokenizer.chat_template", {:string, chat_template}}],
        else: base

    keys = Enum.map(extra, &elem(&1, 0))
    Enum.reject(base, fn {k, _} -> k in keys end) ++ extra
  end
end
