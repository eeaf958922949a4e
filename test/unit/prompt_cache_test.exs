defmodule LlamaCppEx.Server.PromptCacheTest do
  use ExUnit.Case, async: true

  alias LlamaCppEx.Server.PromptCache

  @mb 1_048_576

  defp tokens(from, n), do: Enum.to_list(from..(from + n - 1))
  defp usable(_len, _n), do: true

  # a save op's copy coming back from the engine: {ref, bytes, len}
  defp save(cache, seq, toks, bytes, scope \\ nil) do
    {cache, {:save, ^seq, len, _max, tag}} = PromptCache.save_op(cache, seq, toks, scope)
    PromptCache.saved(cache, tag, {make_ref(), bytes, len}, {[], nil})
  end

  test "an off cache saves nothing and finds nothing" do
    cache = PromptCache.new(0)
    refute PromptCache.enabled?(cache)
    assert {^cache, nil} = PromptCache.save_op(cache, 0, tokens(1, 64), nil)
    assert {nil, 0} = PromptCache.best(cache, tokens(1, 64), nil, &usable/2)
  end

  test "short prefixes are not worth a copy" do
    cache = PromptCache.new(1)
    assert {_, nil} = PromptCache.save_op(cache, 0, tokens(1, 31), nil)
    assert {_, {:save, 0, 32, _, _}} = PromptCache.save_op(cache, 0, tokens(1, 32), nil)
  end

  test "a saved entry is found for a prompt that starts with it, in its scope only" do
    {cache, {:saved, entry, []}} = save(PromptCache.new(1), 0, tokens(1, 64), 1000, "a")
    assert entry.len == 64
    prompt = tokens(1, 64) ++ [999]
    assert {^entry, 64} = PromptCache.best(cache, prompt, "a", &usable/2)
    assert {nil, 0} = PromptCache.best(cache, prompt, "b", &usable/2)
    # at least one token is left to evaluate
    assert {^entry, 63} = PromptCache.best(cache, tokens(1, 64), "a", &usable/2)
    # less than a quarter of the entry matched: not worth restoring
    assert {nil, 0} = PromptCache.best(cache, tokens(1, 15) ++ [0], "a", &usable/2)
    # a sliding window that dropped what the match needs
    assert {nil, 0} = PromptCache.best(cache, prompt, "a", fn _, _ -> false end)
  end

  test "a covered prefix is not saved twice, and a longer one replaces the shorter" do
    {cache, {:saved, short, []}} = save(PromptCache.new(1), 0, tokens(1, 40), 100)
    assert PromptCache.covers?(cache, tokens(1, 40), nil)
    assert {_, nil} = PromptCache.save_op(cache, 1, tokens(1, 40), nil)
    {cache, {:saved, long, [^short]}} = save(cache, 1, tokens(1, 80), 200)
    assert [^long] = cache.entries
    assert cache.bytes == 200
  end

  test "entries are evicted oldest first to stay within the budget" do
    cache = PromptCache.new(1)
    {cache, {:saved, a, []}} = save(cache, 0, tokens(1, 32), div(@mb, 2))
    {cache, {:saved, b, []}} = save(cache, 0, tokens(100, 32), div(@mb, 2))
    {cache, {:saved, _c, [^a]}} = save(cache, 0, tokens(200, 32), div(@mb, 2))
    assert length(cache.entries) == 2 and cache.bytes <= @mb
    assert %{ram_cache_evictions: 1, ram_cache_saves: 3} = PromptCache.stats(cache)
    assert b in cache.entries
  end

  test "a copy larger than the whole budget is dropped" do
    assert {cache, nil} = save(PromptCache.new(1), 0, tokens(1, 32), @mb + 1)
    assert cache.entries == []
  end

  test "save_prefix copies are answered, not kept, and lost ones are reported" do
    cache = PromptCache.new(1)
    from = {self(), make_ref()}
    {cache, {:save, 0, 40, _, tag}} = PromptCache.reply_op(cache, 0, tokens(1, 40), "s", from)
    ref = make_ref()

    assert {cache, {:reply, ^from, {toks, "s", ^ref, 9}}} =
             PromptCache.saved(cache, tag, {ref, 9, 40}, {[], nil})

    assert toks == tokens(1, 40) and cache.entries == []

    {cache, {:save, 0, 40, _, tag}} = PromptCache.reply_op(cache, 0, tokens(1, 40), "s", from)
    assert {_, [^from]} = PromptCache.drop_pending(cache, [tag])
  end

  test "an evicted slot's untagged copy is kept under the slot's tokens" do
    toks = tokens(1, 48)

    {cache, {:saved, entry, []}} =
      PromptCache.saved(PromptCache.new(1), 0, {make_ref(), 10, 40}, {toks, "x"})

    assert entry.tokens == Enum.take(toks, 40) and entry.scope == "x"
    assert PromptCache.covers?(cache, Enum.take(toks, 40), "x")
  end

  test "a loaded prefix must fit the budget of an enabled cache" do
    ref = make_ref()

    assert {:error, :prompt_cache_disabled} =
             PromptCache.load(PromptCache.new(0), [1], nil, ref, 1)

    assert {:error, {:prompt_cache_too_small, _}} =
             PromptCache.load(PromptCache.new(1), tokens(1, 40), nil, ref, 2 * @mb)

    assert {:ok, _cache, %{len: 40}, []} =
             PromptCache.load(PromptCache.new(1), tokens(1, 40), nil, ref, 10)
  end
end
