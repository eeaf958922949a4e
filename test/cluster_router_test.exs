defmodule LlamaCppEx.Cluster.RouterTest do
  use ExUnit.Case, async: true

  alias LlamaCppEx.Cluster.Router

  @conf %{max_waiting: 2, max_kv_use: 0.9}

  defp load(free, queue, kv_free \\ 1000),
    do: %{
      free_slots: free,
      n_parallel: 4,
      queue_depth: queue,
      kv_free_tokens: kv_free,
      n_ctx: 1000
    }

  test "every turn of a conversation has its first turn's key; other openings differ" do
    system = %{"role" => "system", "content" => String.duplicate("Be brief. ", 100)}
    first = [system, %{"role" => "user", "content" => "About tides?"}]
    later = first ++ [%{role: "assistant", content: "Moon."}, %{role: "user", content: "More?"}]
    other = [system, %{"role" => "user", "content" => "About ovens?"}]

    key = Router.key(:chat, first, [], 256)
    assert Router.key(:chat, later, [], 256) == key
    refute Router.key(:chat, other, [], 256) == key
    refute Router.key(:chat, first, [cache_scope: :tenant_b], 256) == key
    assert Router.key(:chat, other, [session: 7], 256) == {:session, 7}

    assert Router.key(:text, "abc" <> String.duplicate("x", 300), [], 256) ==
             Router.key(:text, "abc" <> String.duplicate("x", 400), [], 256)

    assert Router.key(:none, ["a text"], [], 256) == nil
  end

  test "rendezvous order with bounded load" do
    [a, b, c] = for _ <- 1..3, do: spawn(fn -> :ok end)
    idle = Enum.map([a, b, c], &{&1, load(4, 0), 0})
    order = Router.order(idle, :affinity, :k, @conf)
    assert Enum.sort(order) == Enum.sort([a, b, c])
    # the same key, the same order, whatever the members' order
    assert Router.order(Enum.reverse(idle), :affinity, :k, @conf) == order

    # the first in hash order is skipped while its requests would wait more than max_waiting
    [first | rest] = order

    busy =
      Enum.map(idle, fn {p, l, n} -> if p == first, do: {p, load(0, 3), n}, else: {p, l, n} end)

    assert Router.order(busy, :affinity, :k, @conf) == rest ++ [first]

    full_kv =
      Enum.map(idle, fn {p, l, n} ->
        if p == first, do: {p, load(4, 0, 50), n}, else: {p, l, n}
      end)

    assert hd(Router.order(full_kv, :affinity, :k, @conf)) != first

    # no key: the least loaded, pending requests counted
    loaded = [{a, load(1, 0), 0}, {b, load(4, 0), 4}, {c, load(3, 0), 0}]
    assert Router.order(loaded, :affinity, nil, @conf) == [c, a, b]
    assert Router.order(loaded, :least_loaded, :k, @conf) == [c, a, b]
  end
end
