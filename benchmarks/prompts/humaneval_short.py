def rotate_matrix(matrix: list) -> list:
    """Rotate a square matrix by ninety degrees clockwise and return a new matrix.

    >>> rotate_matrix([[1, 2], [3, 4]])
    [[3, 1], [4, 2]]
    >>> rotate_matrix([[1]])
    [[1]]
    """
