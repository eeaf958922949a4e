defmodule LlamaCppEx.UTF8Stream do
  @moduledoc false
  # Holds back an incomplete trailing UTF-8 sequence (up to 3 bytes) so that streamed pieces
  # never split a codepoint. Invalid bytes pass straight through.

  @spec push(binary(), binary()) :: {binary(), binary()}
  def push(pending, chunk) do
    data = pending <> chunk
    split = incomplete_tail(data)
    size = byte_size(data) - split
    <<emit::binary-size(size), rest::binary>> = data
    {emit, rest}
  end

  # Number of trailing bytes that start a multi-byte sequence not yet complete.
  defp incomplete_tail(data) do
    n = byte_size(data)

    Enum.find_value(1..min(3, n)//1, 0, fn back ->
      <<byte>> = binary_part(data, n - back, 1)

      cond do
        Bitwise.band(byte, 0xC0) == 0x80 -> nil
        byte >= 0xF0 and byte <= 0xF7 -> if back < 4, do: back, else: 0
        byte >= 0xE0 and byte <= 0xEF -> if back < 3, do: back, else: 0
        byte >= 0xC0 and byte <= 0xDF -> if back < 2, do: back, else: 0
        true -> 0
      end
    end)
  end
end
